/* The Python interface of the products and the decode operations
 * (foundry.model.kernels._kernels; module.c adds this table to the module). */

#include "py_kernels.h"

static int check_shape(int type, Py_ssize_t rows, Py_ssize_t k, Py_ssize_t have,
                       size_t *row_bytes) {
    int values, bytes;
    if (!type_block(type, &values, &bytes)) {
        PyErr_Format(PyExc_ValueError, "tensor type %d has no kernel", type);
        return -1;
    }
    if (rows < 0 || k <= 0 || k % values || k > (1 << 30)) {
        PyErr_Format(PyExc_ValueError, "rows of %zd values are not whole blocks of %d", k, values);
        return -1;
    }
    *row_bytes = (size_t)(k / values) * bytes;
    if ((size_t)have != (size_t)rows * *row_bytes) {
        PyErr_Format(PyExc_ValueError, "weights hold %zd bytes, %zd rows of %zd values need %zu",
                     have, rows, k, (size_t)rows * *row_bytes);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(matmul_doc,
             "matmul(type, w, n_out, k, x, n, y): y (n, n_out) = x (n, k) @ W.T, W n_out rows of "
             "k values in ggml type `type`; x and y float32 buffers, y written.");

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    int type;
    Py_ssize_t n_out, k, n;
    Py_buffer w, x, y;
    size_t row_bytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*nny*nw*", &type, &w, &n_out, &k, &x, &n, &y)) return NULL;
    PyObject *result = NULL;
    if (check_shape(type, n_out, k, w.len, &row_bytes) < 0) goto done;
    if (n < 0 || x.len != n * k * 4 || y.len != n * n_out * 4) {
        PyErr_Format(PyExc_ValueError, "x holds %zd bytes and y %zd, expected %zd and %zd", x.len,
                     y.len, n * k * 4, n * n_out * 4);
        goto done;
    }
    if (n_out > INT32_MAX || n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "too many rows for one call");
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc =
        matmul(type, w.buf, row_bytes, (int)n_out, (int)k, x.buf, (int)n, y.buf);
    Py_END_ALLOW_THREADS if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return result;
}

PyDoc_STRVAR(matmul_groups_doc,
             "matmul_groups(x, n, k, groups, n_out, y): rows t0 .. t1 - 1 of x (n, k) times each "
             "group's matrix into the same rows of y (n, n_out); groups a tuple of (type, w, t0, "
             "t1), w n_out rows of k values of ggml type `type`, t0 < t1, the groups' rows apart. "
             "Every group in the same pool calls.");

#define MAX_GROUPS MAX_EXPERTS

static PyObject *py_matmul_groups(PyObject *self, PyObject *args) {
    Py_ssize_t n, k, n_out;
    PyObject *groups;
    Py_buffer x, y, w[MAX_GROUPS];
    mm_group g[MAX_GROUPS];
    int count = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnO!nw*", &x, &n, &k, &PyTuple_Type, &groups, &n_out, &y))
        return NULL;
    PyObject *result = NULL;
    if (n < 0 || n_out < 1 || n > INT32_MAX || n_out > INT32_MAX || x.len != n * k * 4 ||
        y.len != n * n_out * 4 || PyTuple_GET_SIZE(groups) > MAX_GROUPS) {
        PyErr_Format(PyExc_ValueError,
                     "matmul_groups: x %zd and y %zd bytes for %zd rows of %zd and %zd, %zd "
                     "groups (at most %d)",
                     x.len, y.len, n, k, n_out, PyTuple_GET_SIZE(groups), MAX_GROUPS);
        goto done;
    }
    for (; count < PyTuple_GET_SIZE(groups); count++) {
        mm_group *m = &g[count];
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(groups, count), "iy*ii", &m->type, &w[count], &m->t0,
                              &m->t1))
            goto done;
        m->w = w[count].buf;
        if (check_shape(m->type, n_out, k, w[count].len, &m->row_bytes) < 0) {
            count++;
            goto done;
        }
        if (m->t0 < 0 || m->t1 <= m->t0 || m->t1 > n || (count && m->t0 < g[count - 1].t1)) {
            PyErr_Format(PyExc_ValueError, "matmul_groups: group %d holds rows %d .. %d of %zd",
                         count, m->t0, m->t1 - 1, n);
            count++;
            goto done;
        }
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = matmul_groups(g, count, (int)n_out, (int)k, x.buf, y.buf);
    Py_END_ALLOW_THREADS if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < count; i++) PyBuffer_Release(&w[i]);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return result;
}

PyDoc_STRVAR(attend_doc,
             "attend(q, k, v, half, n_pos, n_head, n_kv, dh, out): one query row (n_head, dh) "
             "against positions 0 .. n_pos - 1 of a cache k, v (ctx, n_kv, dh), float16 where "
             "half is 1, else float32; out (n_head, dh) written. q and out float32; all "
             "C-contiguous.");

static PyObject *py_attend(PyObject *self, PyObject *args) {
    int half, n_pos, n_head, n_kv, dh;
    Py_buffer q, k, v, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*iiiiiw*", &q, &k, &v, &half, &n_pos, &n_head, &n_kv, &dh,
                          &out))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t row = (Py_ssize_t)n_head * dh * 4,
                     pos = (Py_ssize_t)n_kv * dh * (half ? 2 : 4);
    if ((half != 0 && half != 1) || n_pos < 1 || n_head < 1 || n_kv < 1 || dh < 1 ||
        n_head % n_kv || q.len != row || out.len != row || k.len != v.len || k.len % pos ||
        k.len / pos < n_pos) {
        PyErr_Format(PyExc_ValueError,
                     "attend: q %zd and out %zd bytes for %d heads of %d, a cache of %zd and %zd "
                     "bytes for %d positions of %d kv heads",
                     q.len, out.len, n_head, dh, k.len, v.len, n_pos, n_kv);
        goto done;
    }
    float *p = malloc(((size_t)n_pos * n_head + (size_t)n_kv * dh) * sizeof(float));
    if (p == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS attend(q.buf, k.buf, v.buf, half, n_pos, n_head, n_kv, dh, p, out.buf);
    Py_END_ALLOW_THREADS free(p);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&q);
    PyBuffer_Release(&k);
    PyBuffer_Release(&v);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(dequantize_doc,
             "dequantize(type, w, rows, k, out): the float32 values of `rows` rows of k values of "
             "ggml type `type`, written to `out`.");

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    int type;
    Py_ssize_t rows, k;
    Py_buffer w, out;
    size_t row_bytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*nnw*", &type, &w, &rows, &k, &out)) return NULL;
    PyObject *result = NULL;
    if (check_shape(type, rows, k, w.len, &row_bytes) < 0) goto done;
    if (out.len != rows * k * 4) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, expected %zd", out.len, rows * k * 4);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS for (Py_ssize_t r = 0; r < rows; r++)
        dequant_row(type, (const uint8_t *)w.buf + r * row_bytes, (int)k, (float *)out.buf + r * k);
    Py_END_ALLOW_THREADS result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(attend_rows_doc,
             "attend_rows(q, k, v, half, pos, window, rows, n_head, n_kv, dh, out): rows of "
             "one sequence (rows, n_head, dh) at positions pos, pos + 1, ...: row t attends to "
             "positions 0 .. pos + t of the cache k, v (ctx, n_kv, dh), the last `window` of "
             "them where window > 0; out (rows, n_head, dh) written. On the kernels' pool.");

static PyObject *py_attend_rows(PyObject *self, PyObject *args) {
    int half, pos, window, rows, n_head, n_kv, dh;
    Py_buffer q, k, v, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*iiiiiiiw*", &q, &k, &v, &half, &pos, &window, &rows, &n_head,
                          &n_kv, &dh, &out))
        return NULL;
    const Py_ssize_t row = (Py_ssize_t)n_head * dh * 4, at = (Py_ssize_t)n_kv * dh * (half ? 2 : 4);
    if ((half != 0 && half != 1) || pos < 0 || window < 0 || rows < 1 || n_head < 1 || n_kv < 1 ||
        dh < 1 || n_head % n_kv || q.len != row * rows || out.len != row * rows || k.len != v.len ||
        k.len % at || k.len / at < (Py_ssize_t)pos + rows) {
        PyErr_Format(PyExc_ValueError,
                     "attend_rows: q %zd and out %zd bytes for %d rows of %d heads of %d, a "
                     "cache of %zd and %zd bytes for positions up to %d of %d kv heads",
                     q.len, out.len, rows, n_head, dh, k.len, v.len, pos + rows, n_kv);
        RELEASE_AND_RETURN(NULL, &q, &k, &v, &out);
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc =
        attend_rows(q.buf, k.buf, v.buf, half, pos, window, rows, n_head, n_kv, dh, out.buf);
    Py_END_ALLOW_THREADS if (rc < 0) {
        PyErr_NoMemory();
        RELEASE_AND_RETURN(NULL, &q, &k, &v, &out);
    }
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &q, &k, &v, &out);
}

PyDoc_STRVAR(store_attend_doc,
             "store_attend(q, kx, k_col, k_ld, vx, v_col, v_ld, seqs, window, n_head, n_kv, dh, "
             "out): a batch's rows q (n, n_head, dh) of several sequences, seqs a sequence of "
             "(k, v, pos, rows), the sequences' rows in order: columns k_col .. k_col + n_kv dh "
             "- 1 of kx's rows (k_ld float32 values) and v_col .. of vx's stored in each "
             "sequence's caches k, v (ctx, n_kv, dh; all float16 or all float32, C-contiguous) "
             "at pos, pos + 1, ... as store_rows stores them, then each row's attention as "
             "attend_rows computes it for its sequence; out (n, n_head, dh) written. On the "
             "kernels' pool, one call for the batch.");

/* A cache of store_attend: a C-contiguous (ctx, n_kv, dh) array of float16 ('e') or float32
 * ('f') values, with room for positions up to `end`; its type in *half (the first cache's
 * decides, the others must match). */
static int seq_cache(PyObject *obj, Py_buffer *b, int n_kv, int dh, Py_ssize_t end, int *half) {
    if (PyObject_GetBuffer(obj, b, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    const char *f = b->format ? b->format : "B";
    f += (*f == '<' || *f == '=' || *f == '@');
    const int is_half = f[0] == 'e' && f[1] == 0, is_f32 = f[0] == 'f' && f[1] == 0;
    if ((!is_half && !is_f32) || (*half >= 0 && is_half != *half) || b->ndim != 3 ||
        b->shape[1] != n_kv || b->shape[2] != dh || b->shape[0] < end) {
        PyErr_Format(PyExc_ValueError,
                     "store_attend: a cache must be (ctx >= %zd, %d, %d) of float16 or float32, "
                     "the same type for every sequence; got format %s with %d dimensions",
                     end, n_kv, dh, b->format ? b->format : "B", b->ndim);
        PyBuffer_Release(b);
        return -1;
    }
    *half = is_half;
    return 0;
}

static PyObject *py_store_attend(PyObject *self, PyObject *args) {
    Py_ssize_t k_col, k_ld, v_col, v_ld;
    int window, n_head, n_kv, dh;
    Py_buffer q, kx, vx, out;
    PyObject *seqs_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*nny*nnOiiiiw*", &q, &kx, &k_col, &k_ld, &vx, &v_col, &v_ld,
                          &seqs_obj, &window, &n_head, &n_kv, &dh, &out))
        return NULL;
    PyObject *seqs = PySequence_Fast(seqs_obj, "store_attend: seqs must be a sequence");
    if (seqs == NULL) RELEASE_AND_RETURN(NULL, &q, &kx, &vx, &out);
    const Py_ssize_t count = PySequence_Fast_GET_SIZE(seqs), width = (Py_ssize_t)n_kv * dh;
    attend_seq *items = calloc(count > 0 ? (size_t)count : 1, sizeof(attend_seq));
    Py_buffer *bufs = calloc(count > 0 ? 2 * (size_t)count : 1, sizeof(Py_buffer));
    Py_ssize_t held = 0, n = 0;
    PyObject *result = NULL;
    if (items == NULL || bufs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (count < 1 || count > INT32_MAX || window < 0 || n_head < 1 || n_kv < 1 || dh < 1 ||
        n_head % n_kv || k_col < 0 || k_col + width > k_ld || v_col < 0 || v_col + width > v_ld) {
        PyErr_Format(PyExc_ValueError,
                     "store_attend: %zd sequences, %d heads of %d over %d kv heads, K columns "
                     "%zd of rows of %zd, V columns %zd of rows of %zd",
                     count, n_head, dh, n_kv, k_col, k_ld, v_col, v_ld);
        goto done;
    }
    int half = -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seqs, i);
        PyObject *k, *v;
        Py_ssize_t pos, rows;
        if (!PyTuple_Check(t) || !PyArg_ParseTuple(t, "OOnn", &k, &v, &pos, &rows)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "store_attend: each seq is (k, v, pos, rows)");
            goto done;
        }
        if (pos < 0 || rows < 1 || pos + rows > INT32_MAX || n + rows > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "store_attend: sequence %zd has %zd rows at %zd", i,
                         rows, pos);
            goto done;
        }
        if (seq_cache(k, &bufs[held], n_kv, dh, pos + rows, &half) < 0) goto done;
        held++;
        if (seq_cache(v, &bufs[held], n_kv, dh, pos + rows, &half) < 0) goto done;
        held++;
        items[i] =
            (attend_seq){bufs[held - 2].buf, bufs[held - 1].buf, (int)pos, (int)n, (int)rows};
        n += rows;
    }
    const Py_ssize_t row = (Py_ssize_t)n_head * dh * 4;
    if (!fits("q", &q, n * row) || !fits("out", &out, n * row) || !fits("kx", &kx, n * k_ld * 4) ||
        !fits("vx", &vx, n * v_ld * 4))
        goto done;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = store_attend(q.buf, (const float *)kx.buf + k_col, (size_t)k_ld,
                                             (const float *)vx.buf + v_col, (size_t)v_ld, items,
                                             (int)count, half, window, n_head, n_kv, dh, out.buf);
    Py_END_ALLOW_THREADS if (rc < 0) PyErr_NoMemory();
    else result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&bufs[i]);
    free(bufs);
    free(items);
    Py_DECREF(seqs);
    RELEASE_AND_RETURN(result, &q, &kx, &vx, &out);
}

PyDoc_STRVAR(rmsnorm_doc, "rmsnorm(x, w, n, d, eps, out): out (n, d) = x / rms(x) * w, float32.");

static PyObject *py_rmsnorm(PyObject *self, PyObject *args) {
    int n, d;
    float eps;
    Py_buffer x, w, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*iifw*", &x, &w, &n, &d, &eps, &out)) return NULL;
    const Py_ssize_t rows = (Py_ssize_t)n * d * 4;
    if (n < 0 || d < 1 || !fits("x", &x, rows) || !fits("w", &w, (Py_ssize_t)d * 4) ||
        !fits("out", &out, rows))
        RELEASE_AND_RETURN(NULL, &x, &w, &out);
    Py_BEGIN_ALLOW_THREADS rmsnorm(x.buf, w.buf, n, d, eps, out.buf);
    Py_END_ALLOW_THREADS RELEASE_AND_RETURN(Py_NewRef(Py_None), &x, &w, &out);
}

PyDoc_STRVAR(rope_doc,
             "rope(x, cos, sin, n, heads, dh, neox, out): x (n, heads, dh) turned by cos, sin "
             "(n, dh / 2), pairs (2i, 2i + 1), or (i, i + dh / 2) where neox is 1; out (n, "
             "heads, dh).");

static PyObject *py_rope(PyObject *self, PyObject *args) {
    int n, heads, dh, neox;
    Py_buffer x, cos, sin, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*iiiiw*", &x, &cos, &sin, &n, &heads, &dh, &neox, &out))
        return NULL;
    if (n < 0 || heads < 1 || dh < 2 || dh % 2 || (neox != 0 && neox != 1)) {
        PyErr_Format(PyExc_ValueError, "rope: %d rows of %d heads of %d values", n, heads, dh);
        RELEASE_AND_RETURN(NULL, &x, &cos, &sin, &out);
    }
    const Py_ssize_t values = (Py_ssize_t)n * heads * dh * 4, angles = (Py_ssize_t)n * (dh / 2) * 4;
    if (!fits("x", &x, values) || !fits("cos", &cos, angles) || !fits("sin", &sin, angles) ||
        !fits("out", &out, values))
        RELEASE_AND_RETURN(NULL, &x, &cos, &sin, &out);
    Py_BEGIN_ALLOW_THREADS rope(x.buf, cos.buf, sin.buf, n, heads, dh, neox, out.buf);
    Py_END_ALLOW_THREADS RELEASE_AND_RETURN(Py_NewRef(Py_None), &x, &cos, &sin, &out);
}

PyDoc_STRVAR(swiglu_doc, "swiglu(gu, n, f, out): out (n, f) = silu(g) * u of rows [g | u] of gu.");

static PyObject *py_swiglu(PyObject *self, PyObject *args) {
    int n, f;
    Py_buffer gu, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iiw*", &gu, &n, &f, &out)) return NULL;
    if (n < 0 || f < 1 || !fits("gu", &gu, (Py_ssize_t)n * 2 * f * 4) ||
        !fits("out", &out, (Py_ssize_t)n * f * 4))
        RELEASE_AND_RETURN(NULL, &gu, &out);
    Py_BEGIN_ALLOW_THREADS swiglu(gu.buf, n, f, out.buf);
    Py_END_ALLOW_THREADS RELEASE_AND_RETURN(Py_NewRef(Py_None), &gu, &out);
}

PyDoc_STRVAR(geglu_doc, "geglu(gu, table, n, f, out): out (n, f) = gelu(g) * u of rows [g | u] of "
                        "gu, gelu looked up in table (65536 float32, by float16 bits).");

static PyObject *py_geglu(PyObject *self, PyObject *args) {
    int n, f;
    Py_buffer gu, table, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*iiw*", &gu, &table, &n, &f, &out)) return NULL;
    if (n < 0 || f < 1 || !fits("gu", &gu, (Py_ssize_t)n * 2 * f * 4) ||
        !fits("table", &table, (Py_ssize_t)65536 * 4) || !fits("out", &out, (Py_ssize_t)n * f * 4))
        RELEASE_AND_RETURN(NULL, &gu, &table, &out);
    Py_BEGIN_ALLOW_THREADS geglu(gu.buf, table.buf, n, f, out.buf);
    Py_END_ALLOW_THREADS RELEASE_AND_RETURN(Py_NewRef(Py_None), &gu, &table, &out);
}

PyDoc_STRVAR(route_doc,
             "route(x, w, n, d, n_expert, k, weights, top): each row's k experts (top, int64) "
             "and their renormalised probabilities (weights, float32), from x (n, d) and the "
             "router w (n_expert, d).");

static PyObject *py_route(PyObject *self, PyObject *args) {
    int n, d, n_expert, k;
    Py_buffer x, w, weights, top;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*iiiiw*w*", &x, &w, &n, &d, &n_expert, &k, &weights, &top))
        return NULL;
    if (n < 0 || d < 1 || n_expert < 1 || n_expert > MAX_EXPERTS || k < 1 || k > n_expert) {
        PyErr_Format(PyExc_ValueError, "route: %d of %d experts (at most %d)", k, n_expert,
                     MAX_EXPERTS);
        RELEASE_AND_RETURN(NULL, &x, &w, &weights, &top);
    }
    if (!fits("x", &x, (Py_ssize_t)n * d * 4) || !fits("w", &w, (Py_ssize_t)n_expert * d * 4) ||
        !fits("weights", &weights, (Py_ssize_t)n * k * 4) ||
        !fits("top", &top, (Py_ssize_t)n * k * 8))
        RELEASE_AND_RETURN(NULL, &x, &w, &weights, &top);
    Py_BEGIN_ALLOW_THREADS route(x.buf, w.buf, n, d, n_expert, k, weights.buf, top.buf);
    Py_END_ALLOW_THREADS RELEASE_AND_RETURN(Py_NewRef(Py_None), &x, &w, &weights, &top);
}

PyDoc_STRVAR(assign_doc,
             "assign(top, first, n_local, order, bounds) -> M: the M assignments (flat indices "
             "of top, int64) to experts first .. first + n_local - 1 grouped by expert into "
             "order[:M], their bounds (n_local + 1, int64).");

static PyObject *py_assign(PyObject *self, PyObject *args) {
    long long first;
    int n_local;
    Py_buffer top, order, bounds;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*Liw*w*", &top, &first, &n_local, &order, &bounds)) return NULL;
    if (n_local < 0 || n_local > MAX_EXPERTS || top.len % 8) {
        PyErr_Format(PyExc_ValueError, "assign: %d local experts (at most %d), top %zd bytes",
                     n_local, MAX_EXPERTS, top.len);
        RELEASE_AND_RETURN(NULL, &top, &order, &bounds);
    }
    if (!fits("order", &order, top.len) || !fits("bounds", &bounds, (Py_ssize_t)(n_local + 1) * 8))
        RELEASE_AND_RETURN(NULL, &top, &order, &bounds);
    int64_t m;
    Py_BEGIN_ALLOW_THREADS m = assign(top.buf, top.len / 8, first, n_local, order.buf, bounds.buf);
    Py_END_ALLOW_THREADS RELEASE_AND_RETURN(PyLong_FromLongLong(m), &top, &order, &bounds);
}

PyDoc_STRVAR(combine_doc,
             "combine(ys, weights, order, n, k, d, out): out (n, d) = each row's weighted sum of "
             "the expert outputs ys (M, d) of the assignments order (M, int64, distinct, < n k).");

static PyObject *py_combine(PyObject *self, PyObject *args) {
    int n, k, d;
    Py_buffer ys, weights, order, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*iiiw*", &ys, &weights, &order, &n, &k, &d, &out))
        return NULL;
    const int64_t m = order.len / 8, *o = order.buf;
    if (n < 0 || k < 1 || d < 1 || order.len % 8 || !fits("ys", &ys, (Py_ssize_t)m * d * 4) ||
        !fits("weights", &weights, (Py_ssize_t)n * k * 4) ||
        !fits("out", &out, (Py_ssize_t)n * d * 4))
        RELEASE_AND_RETURN(NULL, &ys, &weights, &order, &out);
    int64_t *slot = malloc(((size_t)n * k + 1) * sizeof(int64_t));
    if (slot == NULL) {
        PyErr_NoMemory();
        RELEASE_AND_RETURN(NULL, &ys, &weights, &order, &out);
    }
    for (int64_t a = 0; a < (int64_t)n * k; a++) slot[a] = -1;
    for (int64_t i = 0; i < m; i++) { /* the assignments' rows of ys, each assignment once */
        if (o[i] < 0 || o[i] >= (int64_t)n * k || slot[o[i]] >= 0) {
            free(slot);
            PyErr_Format(PyExc_ValueError,
                         "combine: order[%lld] = %lld is not a distinct "
                         "assignment of %d rows of %d",
                         (long long)i, (long long)o[i], n, k);
            RELEASE_AND_RETURN(NULL, &ys, &weights, &order, &out);
        }
        slot[o[i]] = i;
    }
    Py_BEGIN_ALLOW_THREADS combine(ys.buf, weights.buf, slot, n, k, d, out.buf);
    Py_END_ALLOW_THREADS free(slot);
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &ys, &weights, &order, &out);
}

PyDoc_STRVAR(add_doc, "add(a, b, n, d, out): out (n, d) = a + b, float32; out may be a.");

static PyObject *py_add(PyObject *self, PyObject *args) {
    int n, d;
    Py_buffer a, b, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*iiw*", &a, &b, &n, &d, &out)) return NULL;
    const Py_ssize_t size = (Py_ssize_t)n * d * 4;
    if (n < 0 || d < 1 || !fits("a", &a, size) || !fits("b", &b, size) || !fits("out", &out, size))
        RELEASE_AND_RETURN(NULL, &a, &b, &out);
    Py_BEGIN_ALLOW_THREADS add_rows(a.buf, b.buf, n, d, out.buf);
    Py_END_ALLOW_THREADS RELEASE_AND_RETURN(Py_NewRef(Py_None), &a, &b, &out);
}

PyDoc_STRVAR(store_rows_doc,
             "store_rows(x, col, ld, n, d, half, out): columns col .. col + d - 1 of the n rows "
             "of ld float32 values x into n consecutive rows of out (a cache's), float16 where "
             "half is 1.");

static PyObject *py_store_rows(PyObject *self, PyObject *args) {
    Py_ssize_t col, ld;
    int n, d, half;
    Py_buffer x, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nniiiw*", &x, &col, &ld, &n, &d, &half, &out)) return NULL;
    if (n < 0 || d < 1 || col < 0 || col + d > ld || (half != 0 && half != 1)) {
        PyErr_Format(PyExc_ValueError, "store_rows: columns %zd .. %zd of rows of %zd values", col,
                     col + d - 1, ld);
        RELEASE_AND_RETURN(NULL, &x, &out);
    }
    if (!fits("x", &x, (Py_ssize_t)n * ld * 4) ||
        !fits("out", &out, (Py_ssize_t)n * d * (half ? 2 : 4)))
        RELEASE_AND_RETURN(NULL, &x, &out);
    Py_BEGIN_ALLOW_THREADS store_rows((const float *)x.buf + col, (size_t)ld, n, d, half, out.buf);
    Py_END_ALLOW_THREADS RELEASE_AND_RETURN(Py_NewRef(Py_None), &x, &out);
}

PyDoc_STRVAR(take_rows_doc, "take_rows(x, rows, idx, d, out): out (m, d) = rows idx (m, int64, "
                            "each < rows) of x (rows, d), float32.");

static PyObject *py_take_rows(PyObject *self, PyObject *args) {
    int rows, d;
    Py_buffer x, idx, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*iy*iw*", &x, &rows, &idx, &d, &out)) return NULL;
    const Py_ssize_t m = idx.len / 8;
    if (rows < 0 || d < 1 || idx.len % 8 || m > INT32_MAX ||
        !fits("x", &x, (Py_ssize_t)rows * d * 4) || !fits("out", &out, m * d * 4))
        RELEASE_AND_RETURN(NULL, &x, &idx, &out);
    const int64_t *at = idx.buf;
    for (Py_ssize_t i = 0; i < m; i++)
        if (at[i] < 0 || at[i] >= rows) {
            PyErr_Format(PyExc_ValueError, "take_rows: idx[%zd] = %lld is not a row of %d", i,
                         (long long)at[i], rows);
            RELEASE_AND_RETURN(NULL, &x, &idx, &out);
        }
    Py_BEGIN_ALLOW_THREADS take_rows(x.buf, at, (int)m, d, out.buf);
    Py_END_ALLOW_THREADS RELEASE_AND_RETURN(Py_NewRef(Py_None), &x, &idx, &out);
}

PyMethodDef ops_methods[] = {
    {"matmul", py_matmul, METH_VARARGS, matmul_doc},
    {"matmul_groups", py_matmul_groups, METH_VARARGS, matmul_groups_doc},
    {"dequantize", py_dequantize, METH_VARARGS, dequantize_doc},
    {"attend", py_attend, METH_VARARGS, attend_doc},
    {"attend_rows", py_attend_rows, METH_VARARGS, attend_rows_doc},
    {"store_attend", py_store_attend, METH_VARARGS, store_attend_doc},
    {"rmsnorm", py_rmsnorm, METH_VARARGS, rmsnorm_doc},
    {"rope", py_rope, METH_VARARGS, rope_doc},
    {"swiglu", py_swiglu, METH_VARARGS, swiglu_doc},
    {"geglu", py_geglu, METH_VARARGS, geglu_doc},
    {"route", py_route, METH_VARARGS, route_doc},
    {"assign", py_assign, METH_VARARGS, assign_doc},
    {"combine", py_combine, METH_VARARGS, combine_doc},
    {"add", py_add, METH_VARARGS, add_doc},
    {"store_rows", py_store_rows, METH_VARARGS, store_rows_doc},
    {"take_rows", py_take_rows, METH_VARARGS, take_rows_doc},
    {NULL, NULL, 0, NULL},
};
