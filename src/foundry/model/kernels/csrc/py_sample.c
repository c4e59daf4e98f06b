/* The Python interface of sample.c: sample_rows(rows, args, out) and sample_parts(...). */

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

static const char sample_parts_doc[] =
    "sample_parts(z, e, bsum, args, out, cand_e, cand_id): a rank's part of the draw of rows cut "
    "into vocabulary blocks (sample.c, A row in blocks), a row a task on the pool. z: R x V "
    "float32 logits of this rank's block; e: R x V float32 and bsum: R x ceil(V / 64) float64, "
    "the probabilities and block masses (written by PART_PASS and PART_TAIL, read by the other "
    "modes; PART_FINISH also reads back the nonzero and last of its row's PART_PASS in out); args: "
    "R x 8 float64 (mode, top, inv, acc, u, target, top_k, nonzero); out: R x 7 "
    "float64 (nonzero, last, mass, kind, index, target, n); cand_e: R x K float32 and cand_id: "
    "R x K int64, each row's top-k candidates.";

static PyObject *py_sample_parts(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer z, e, bsum, a, out, ce, cid;
    if (!PyArg_ParseTuple(args, "y*w*w*y*w*w*w*", &z, &e, &bsum, &a, &out, &ce, &cid)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t rows = a.len / (Py_ssize_t)(PART_ARGS * sizeof(double));
    const Py_ssize_t v = rows > 0 ? z.len / rows / (Py_ssize_t)sizeof(float) : 0;
    const Py_ssize_t nb = (v + 63) / 64;
    const Py_ssize_t k = rows > 0 ? ce.len / rows / (Py_ssize_t)sizeof(float) : 0;
    if (rows == 0 || v == 0 || a.len != rows * PART_ARGS * (Py_ssize_t)sizeof(double) ||
        z.len != rows * v * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError,
                        "sample_parts: z must hold R rows of V float32 and args R x 8 float64");
        goto done;
    }
    if (!fits("e", &e, rows * v * (Py_ssize_t)sizeof(float)) ||
        !fits("bsum", &bsum, rows * nb * (Py_ssize_t)sizeof(double)) ||
        !fits("out", &out, rows * PART_OUTS * (Py_ssize_t)sizeof(double)) ||
        !fits("cand_id", &cid, rows * k * (Py_ssize_t)sizeof(int64_t)))
        goto done;
    for (Py_ssize_t i = 0; i < rows; i++) {
        const double top_k = ((const double *)a.buf)[i * PART_ARGS + ARG_TOP_K];
        if (top_k < 0 || top_k > (double)k) {
            PyErr_Format(PyExc_ValueError,
                         "sample_parts: row %zd's top_k exceeds the %zd "
                         "candidates cand_e holds a row",
                         i, k);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS sample_parts(z.buf, (int)rows, (int64_t)v, e.buf, bsum.buf, a.buf,
                                        out.buf, (int64_t)k, ce.buf, cid.buf);
    Py_END_ALLOW_THREADS result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&z);
    PyBuffer_Release(&e);
    PyBuffer_Release(&bsum);
    PyBuffer_Release(&a);
    PyBuffer_Release(&out);
    PyBuffer_Release(&ce);
    PyBuffer_Release(&cid);
    return result;
}

PyMethodDef sample_methods[] = {
    {"sample_rows", py_sample_rows, METH_VARARGS, sample_rows_doc},
    {"sample_parts", py_sample_parts, METH_VARARGS, sample_parts_doc},
    {NULL, NULL, 0, NULL},
};
