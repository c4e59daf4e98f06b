/* AdamW's step for one tensor in one pass (foundry.model.train.optim has the numpy version and the
 * maths; docs/architecture.md, "The optimizer in C").
 *
 * adamw(p, g, m, v, decay, shrink, b1, one_minus_b1, b2, one_minus_b2, bc2_sqrt, eps, step_size)
 * updates the float32 buffers p, m, v in place from g (all of n values) with the float32
 * operations of the numpy version in its order, each rounded once (setup.py builds with
 * -ffp-contract=off), so both give the same bits on every architecture:
 *
 *   p = p * shrink                          (only if decay)
 *   m = m * b1 + g * one_minus_b1
 *   v = v * b2 + (g * g) * one_minus_b2
 *   p = p - (m / (sqrt(v) / bc2_sqrt + eps)) * step_size
 *
 * numpy makes about a dozen passes over five arrays for this; one pass reads four and writes
 * three. The scalars are float32 values passed as Python floats (exact).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

static void adamw(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                  Py_ssize_t n, int decay, float shrink, float b1, float omb1, float b2, float omb2,
                  float bc2, float eps, float step) {
    if (decay)
        for (Py_ssize_t i = 0; i < n; i++) p[i] = p[i] * shrink;
    for (Py_ssize_t i = 0; i < n; i++) {
        const float gi = g[i];
        const float mi = m[i] * b1 + gi * omb1;
        const float vi = v[i] * b2 + (gi * gi) * omb2;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] - (mi / (sqrtf(vi) / bc2 + eps)) * step;
    }
}

static PyObject *py_adamw(PyObject *self, PyObject *args) {
    Py_buffer p, g, m, v;
    int decay;
    float shrink, b1, omb1, b2, omb2, bc2, eps, step;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*w*w*pffffffff", &p, &g, &m, &v, &decay, &shrink, &b1, &omb1,
                          &b2, &omb2, &bc2, &eps, &step))
        return NULL;
    PyObject *result = NULL;
    if (p.len % 4 || g.len != p.len || m.len != p.len || v.len != p.len) {
        PyErr_SetString(PyExc_ValueError, "adamw: p, g, m, v must be float32 buffers of one size");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS adamw((float *)p.buf, (const float *)g.buf, (float *)m.buf,
                                 (float *)v.buf, p.len / 4, decay, shrink, b1, omb1, b2, omb2, bc2,
                                 eps, step);
    Py_END_ALLOW_THREADS result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&p);
    PyBuffer_Release(&g);
    PyBuffer_Release(&m);
    PyBuffer_Release(&v);
    return result;
}

static PyMethodDef methods[] = {
    {"adamw", py_adamw, METH_VARARGS,
     "adamw(p, g, m, v, decay, shrink, b1, 1-b1, b2, 1-b2, sqrt(1-b2^t), eps, step): in place"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_optim", "AdamW's step in C (foundry.model.train.optim).", -1, methods,
};

PyMODINIT_FUNC PyInit__optim(void) {
    return PyModule_Create(&module);
}
