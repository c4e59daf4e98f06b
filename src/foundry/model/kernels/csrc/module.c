/* The Python interface of foundry.model.kernels._kernels: the module, the instruction set
 * and the threads; the products' and decode operations' bindings are py_ops.c's, the
 * one-token step's py_step.c's (each family its own method table, added here). */

#include "py_kernels.h"

#if defined(FOUNDRY_X86)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* AMX's tiles usable by this process: cpuid says amx-tile and amx-int8 (leaf 7, edx bits 24
 * and 25), and Linux grants the tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA: once, for every thread of the process). Asked once, at import. */
static int amx_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
        return 0;
#if defined(__linux__) && defined(SYS_arch_prctl)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    return 0;
#endif
}
static int amx_ok;

static void detect_x86(int simd) {
    use_avx2 = simd && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    use_vnni =
        use_avx2 && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    use_512 = use_vnni && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    use_amx = use_512 && amx_ok;
}
#endif

static PyObject *py_isa(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
#if defined(FOUNDRY_X86)
    return PyUnicode_FromString(use_amx    ? "avx512-vnni+amx"
                                : use_512  ? "avx512-vnni"
                                : use_vnni ? "avx2+vnni"
                                : use_avx2 ? "avx2"
                                           : "portable");
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD)
    return PyUnicode_FromString("neon-dotprod");
#elif defined(__ARM_NEON)
    return PyUnicode_FromString("neon");
#else
    return PyUnicode_FromString("portable");
#endif
}

static PyObject *py_use(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
#if defined(FOUNDRY_X86)
    if (strcmp(name, "portable") == 0) {
        detect_x86(0);
    } else if (strcmp(name, "avx2") == 0 || strcmp(name, "best") == 0) {
        detect_x86(1);
        if (!use_avx2) return PyErr_Format(PyExc_ValueError, "this CPU has no AVX2 and F16C");
        if (strcmp(name, "avx2") == 0) use_vnni = use_512 = use_amx = 0;
    } else if (strcmp(name, "avx2+vnni") == 0) {
        detect_x86(1);
        if (!use_vnni) return PyErr_Format(PyExc_ValueError, "this CPU has no AVX-512 VNNI");
        use_512 = use_amx = 0;
    } else if (strcmp(name, "avx512-vnni") == 0) {
        detect_x86(1);
        if (!use_512) return PyErr_Format(PyExc_ValueError, "this CPU has no AVX-512 VNNI");
        use_amx = 0;
    } else if (strcmp(name, "avx512-vnni+amx") == 0) {
        detect_x86(1);
        if (!use_amx) return PyErr_Format(PyExc_ValueError, "AMX's int8 tiles are not usable here");
    } else {
        return PyErr_Format(PyExc_ValueError, "unknown kernel path %s", name);
    }
#else
    if (strcmp(name, "portable") != 0 && strcmp(name, "best") != 0)
        return PyErr_Format(PyExc_ValueError, "unknown kernel path %s", name);
#endif
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_threads_doc,
             "set_threads(n): the kernels' pool runs every product on n threads (this one "
             "included) from now on; the results are the same bits at any n.");

static PyObject *py_set_threads(PyObject *self, PyObject *arg) {
    (void)self;
    const long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > 512)
        return PyErr_Format(PyExc_ValueError, "threads must be 1 .. 512, got %ld", n);
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = pool_set_threads((int)n);
    Py_END_ALLOW_THREADS if (rc < 0) return PyErr_Format(PyExc_OSError,
                                                         "could not start %ld threads", n);
    Py_RETURN_NONE;
}

static PyObject *py_split_below(PyObject *self, PyObject *arg) {
    (void)self;
    const long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    pool_split_below(n);
    Py_RETURN_NONE;
}

static PyObject *py_threads(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromLong(pool_threads());
}

PyDoc_STRVAR(profile_doc,
             "profile(on): the counters of where the one-token step's time went since the last "
             "call, {phase: (nanoseconds, calls)}, reset; counting on from now if on.");

static PyObject *py_profile(PyObject *self, PyObject *arg) {
    (void)self;
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    static const char *const names[PROF_N] = {"layer", "qkv",  "attention", "out",
                                              "ffn",   "pool", "join",      "alone"};
    PyObject *d = PyDict_New();
    for (int i = 0; d != NULL && i < PROF_N; i++) {
        PyObject *v = Py_BuildValue("(KK)", (unsigned long long)prof_ns[i],
                                    (unsigned long long)prof_calls[i]);
        if (v == NULL || PyDict_SetItemString(d, names[i], v) < 0) Py_CLEAR(d);
        Py_XDECREF(v);
        prof_ns[i] = prof_calls[i] = 0;
    }
    prof_on = on;
    return d;
}

static PyMethodDef methods[] = {
    {"profile", py_profile, METH_O, profile_doc},
    {"set_threads", py_set_threads, METH_O, set_threads_doc},
    {"threads", py_threads, METH_NOARGS, "The threads the kernels' pool runs on."},
    {"split_below", py_split_below, METH_O,
     "split_below(bytes): products of less work (weight bytes x inputs per thread) run on "
     "one thread (default 65536; tests set 0 to split tiny ones)."},
    {"isa", py_isa, METH_NOARGS, "The instruction set the kernels use here."},
    {"use", py_use, METH_O,
     "use(path): 'best' (the default), 'avx512-vnni' (without AMX), 'avx2+vnni', 'avx2' "
     "(without VNNI) or 'portable' C (tests); 'avx512-vnni+amx' where AMX is usable."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "_kernels",
    "Dot products over GGUF weight blocks (see foundry.model.kernels.quant).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    kernels_init();
#if defined(FOUNDRY_X86)
    __builtin_cpu_init();
    amx_ok = amx_usable();
    detect_x86(1);
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddFunctions(m, ops_methods) < 0 || PyModule_AddFunctions(m, step_methods) < 0 ||
        PyModule_AddFunctions(m, sample_methods) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
