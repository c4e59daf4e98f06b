/* The Python interface of sample.c: sample_rows(rows, args, out). */

#include "py_kernels.h"

static const char sample_rows_doc[] =
    "sample_rows(rows, args, out): the next token of each row (sample.c), a row a task on the "
    "pool. rows: a list of R contiguous float32 rows of V logits; args: R x 4 float64 "
    "(temperature, top_p, u, top_k); out: R int64, each a token, or -1 (a NaN or +inf logit), "
    "-2 (every logit -inf), -3 (no memory).";

static PyObject *py_sample_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *rows;
    Py_buffer a, out;
    if (!PyArg_ParseTuple(args, "O!y*w*", &PyList_Type, &rows, &a, &out)) return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(rows);
    Py_ssize_t v = -1;
    Py_buffer *bufs = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *bufs);
    const float **z = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *z);
    sample_args *sa = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof *sa);
    Py_ssize_t got = 0;
    PyObject *result = NULL;
    if (bufs == NULL || z == NULL || sa == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (!fits("args", &a, n * 4 * (Py_ssize_t)sizeof(double)) ||
        !fits("out", &out, n * (Py_ssize_t)sizeof(int64_t)))
        goto done;
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(rows, got), &bufs[got], PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        const Py_ssize_t len = bufs[got].len / (Py_ssize_t)sizeof(float);
        if (v < 0) v = len;
        if (len != v || len == 0 || bufs[got].len % (Py_ssize_t)sizeof(float)) {
            got++;
            PyErr_Format(PyExc_ValueError,
                         "row %zd holds %zd bytes; every row must hold the "
                         "first's %zd float32 values (at least one)",
                         got - 1, bufs[got - 1].len, v);
            goto done;
        }
        z[got] = bufs[got].buf;
        const double *p = (const double *)a.buf + 4 * got;
        sa[got] = (sample_args){p[0], p[1], p[2], (int64_t)p[3]};
    }
    Py_BEGIN_ALLOW_THREADS sample_rows(z, (int)n, (int64_t)v, sa, out.buf);
    Py_END_ALLOW_THREADS result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(z);
    PyMem_Free(sa);
    PyBuffer_Release(&a);
    PyBuffer_Release(&out);
    return result;
}

PyMethodDef sample_methods[] = {
    {"sample_rows", py_sample_rows, METH_VARARGS, sample_rows_doc},
    {NULL, NULL, 0, NULL},
};
