/* The Python interface of foundry.model.kernels._kernels. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "kernels.h"

/* ---- Python interface ---------------------------------------------------------------------- */

static int check_shape(int type, Py_ssize_t rows, Py_ssize_t k, Py_ssize_t have, size_t *row_bytes) {
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
        PyErr_Format(PyExc_ValueError, "x holds %zd bytes and y %zd, expected %zd and %zd",
                     x.len, y.len, n * k * 4, n * n_out * 4);
        goto done;
    }
    if (n_out > INT32_MAX || n > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "too many rows for one call");
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = matmul(type, w.buf, row_bytes, (int)n_out, (int)k, x.buf, (int)n, y.buf);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
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
        n_head % n_kv || q.len != row ||
        out.len != row || k.len != v.len || k.len % pos || k.len / pos < n_pos) {
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
    Py_BEGIN_ALLOW_THREADS
    attend(q.buf, k.buf, v.buf, half, n_pos, n_head, n_kv, dh, p, out.buf);
    Py_END_ALLOW_THREADS
    free(p);
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
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++)
        dequant_row(type, (const uint8_t *)w.buf + r * row_bytes, (int)k, (float *)out.buf + r * k);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return result;
}

/* A buffer of one call of the decode operations below: it must hold exactly `need` bytes. */
static int fits(const char *what, const Py_buffer *b, Py_ssize_t need) {
    if (need < 0 || b->len != need) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, expected %zd", what, b->len, need);
        return 0;
    }
    return 1;
}

#define RELEASE_AND_RETURN(result, ...)                                                        \
    do {                                                                                       \
        Py_buffer *bufs_[] = {__VA_ARGS__};                                                    \
        for (size_t i_ = 0; i_ < sizeof bufs_ / sizeof bufs_[0]; i_++) PyBuffer_Release(bufs_[i_]); \
        return result;                                                                         \
    } while (0)

PyDoc_STRVAR(attend_rows_doc,
             "attend_rows(q, k, v, half, pos, window, rows, n_head, n_kv, dh, out): rows of "
             "one sequence (rows, n_head, dh) at positions pos, pos + 1, ...: row t attends to "
             "positions 0 .. pos + t of the cache k, v (ctx, n_kv, dh), the last `window` of "
             "them where window > 0; out (rows, n_head, dh) written. On the kernels' pool.");

static PyObject *py_attend_rows(PyObject *self, PyObject *args) {
    int half, pos, window, rows, n_head, n_kv, dh;
    Py_buffer q, k, v, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*iiiiiiiw*", &q, &k, &v, &half, &pos, &window, &rows,
                          &n_head, &n_kv, &dh, &out))
        return NULL;
    const Py_ssize_t row = (Py_ssize_t)n_head * dh * 4,
                     at = (Py_ssize_t)n_kv * dh * (half ? 2 : 4);
    if ((half != 0 && half != 1) || pos < 0 || window < 0 || rows < 1 || n_head < 1 ||
        n_kv < 1 || dh < 1 || n_head % n_kv || q.len != row * rows || out.len != row * rows ||
        k.len != v.len || k.len % at || k.len / at < (Py_ssize_t)pos + rows) {
        PyErr_Format(PyExc_ValueError,
                     "attend_rows: q %zd and out %zd bytes for %d rows of %d heads of %d, a "
                     "cache of %zd and %zd bytes for positions up to %d of %d kv heads",
                     q.len, out.len, rows, n_head, dh, k.len, v.len, pos + rows, n_kv);
        RELEASE_AND_RETURN(NULL, &q, &k, &v, &out);
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = attend_rows(q.buf, k.buf, v.buf, half, pos, window, rows, n_head, n_kv, dh, out.buf);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        PyErr_NoMemory();
        RELEASE_AND_RETURN(NULL, &q, &k, &v, &out);
    }
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &q, &k, &v, &out);
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
    Py_BEGIN_ALLOW_THREADS
    rmsnorm(x.buf, w.buf, n, d, eps, out.buf);
    Py_END_ALLOW_THREADS
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &x, &w, &out);
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
    Py_BEGIN_ALLOW_THREADS
    rope(x.buf, cos.buf, sin.buf, n, heads, dh, neox, out.buf);
    Py_END_ALLOW_THREADS
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &x, &cos, &sin, &out);
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
    Py_BEGIN_ALLOW_THREADS
    swiglu(gu.buf, n, f, out.buf);
    Py_END_ALLOW_THREADS
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &gu, &out);
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
    Py_BEGIN_ALLOW_THREADS
    geglu(gu.buf, table.buf, n, f, out.buf);
    Py_END_ALLOW_THREADS
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &gu, &table, &out);
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
    if (!fits("x", &x, (Py_ssize_t)n * d * 4) ||
        !fits("w", &w, (Py_ssize_t)n_expert * d * 4) ||
        !fits("weights", &weights, (Py_ssize_t)n * k * 4) ||
        !fits("top", &top, (Py_ssize_t)n * k * 8))
        RELEASE_AND_RETURN(NULL, &x, &w, &weights, &top);
    Py_BEGIN_ALLOW_THREADS
    route(x.buf, w.buf, n, d, n_expert, k, weights.buf, top.buf);
    Py_END_ALLOW_THREADS
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &x, &w, &weights, &top);
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
    if (!fits("order", &order, top.len) ||
        !fits("bounds", &bounds, (Py_ssize_t)(n_local + 1) * 8))
        RELEASE_AND_RETURN(NULL, &top, &order, &bounds);
    int64_t m;
    Py_BEGIN_ALLOW_THREADS
    m = assign(top.buf, top.len / 8, first, n_local, order.buf, bounds.buf);
    Py_END_ALLOW_THREADS
    RELEASE_AND_RETURN(PyLong_FromLongLong(m), &top, &order, &bounds);
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
            PyErr_Format(PyExc_ValueError, "combine: order[%lld] = %lld is not a distinct "
                         "assignment of %d rows of %d", (long long)i, (long long)o[i], n, k);
            RELEASE_AND_RETURN(NULL, &ys, &weights, &order, &out);
        }
        slot[o[i]] = i;
    }
    Py_BEGIN_ALLOW_THREADS
    combine(ys.buf, weights.buf, slot, n, k, d, out.buf);
    Py_END_ALLOW_THREADS
    free(slot);
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &ys, &weights, &order, &out);
}

/* ---- the one-token step (step.c) ------------------------------------------------------------ */

#define STEP_CAPSULE "foundry.model.kernels._kernels.step_layer"

static int step_fail(const char *what) {
    PyErr_Format(PyExc_ValueError, "step_plan: %s", what);
    return 0;
}

/* quant.StepMat (type, address, rows, k): a matrix of stored blocks the caller keeps alive. */
static int parse_mat(PyObject *o, step_mat *m) {
    unsigned long long address;
    int values, bytes;
    if (!PyArg_ParseTuple(o, "iKii", &m->type, &address, &m->rows, &m->k)) return 0;
    if (!type_block(m->type, &values, &bytes) || m->type == T_F32)
        return step_fail("a matrix type without a block kernel");
    if (m->rows < 1 || m->k < 1 || m->k % values || address == 0)
        return step_fail("a matrix of no rows, or rows not whole blocks");
    m->row_bytes = (size_t)(m->k / values) * bytes;
    m->w = (const uint8_t *)(uintptr_t)address;
    return 1;
}

static int parse_mats(PyObject *o, step_mat *m, int most, int *n) {
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) > most) return step_fail("too many matrices");
    *n = (int)PyTuple_GET_SIZE(o);
    for (int i = 0; i < *n; i++)
        if (!parse_mat(PyTuple_GET_ITEM(o, i), &m[i])) return 0;
    return 1;
}

static int rows_of(const step_mat *m, int n) {
    int rows = 0;
    for (int i = 0; i < n; i++) rows += m[i].rows;
    return rows;
}

/* ((gate_up matrices), down) of each routed expert a part holds, experts of n_ff rows. */
static int parse_experts(PyObject *o, const step_layer *l, step_part *p) {
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) > l->n_expert)
        return step_fail("more experts than the router chooses among");
    p->n_exp = (int)PyTuple_GET_SIZE(o);
    if (p->first_exp < 0 || p->first_exp + p->n_exp > l->n_expert)
        return step_fail("experts outside the router's");
    p->experts = calloc(p->n_exp ? (size_t)p->n_exp : 1, sizeof *p->experts);
    if (p->experts == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    for (int e = 0; e < p->n_exp; e++) {
        step_expert *x = &p->experts[e];
        PyObject *gate_up, *down;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(o, e), "OO", &gate_up, &down) ||
            !parse_mats(gate_up, x->gate_up, 2, &x->n_gate_up) || !parse_mat(down, &x->down))
            return 0;
        if (x->n_gate_up < 1 || rows_of(x->gate_up, x->n_gate_up) != 2 * x->down.k ||
            x->down.rows != l->d)
            return step_fail("expert matrices that do not fit");
        for (int i = 0; i < x->n_gate_up; i++)
            if (x->gate_up[i].k != l->d) return step_fail("an expert matrix not of the width");
    }
    return 1;
}

static int parse_part(PyObject *o, const step_layer *l, step_part *p) {
    PyObject *qkv, *out, *gate_up, *down, *experts;
    unsigned long long bias[3], q_norm, k_norm;
    if (!PyArg_ParseTuple(o, "OOOOiiiiiiiiiiKKKKKiO", &qkv, &out, &gate_up, &down, &p->n_q,
                          &p->n_k, &p->n_v, &p->n_kv, &p->n_ff, &p->q_keep[0], &p->q_keep[1],
                          &p->k_keep[0], &p->k_keep[1], &p->skip_kv, &bias[0], &bias[1],
                          &bias[2], &q_norm, &k_norm, &p->first_exp, &experts))
        return 0;
    if (!parse_mats(qkv, p->qkv, 3, &p->n_qkv) || !parse_mat(out, &p->out) ||
        !parse_mats(gate_up, p->gate_up, 2, &p->n_gate_up))
        return 0;
    if (l->router != NULL) {
        if (p->n_gate_up > 0) return step_fail("a dense FFN beside routed experts");
        if (!parse_experts(experts, l, p)) return 0;
    }
    p->has_ffn = p->n_gate_up > 0 || l->router != NULL;
    if (p->n_gate_up > 0 && !parse_mat(down, &p->down)) return 0;
    for (int i = 0; i < 3; i++) p->bias[i] = (const float *)(uintptr_t)bias[i];
    p->q_norm = (const float *)(uintptr_t)q_norm;
    p->k_norm = (const float *)(uintptr_t)k_norm;
    const int dh = l->dh, heads = p->q_keep[1] - p->q_keep[0];
    if (p->n_q % dh || p->n_k % dh || p->n_v != p->n_kv * dh || p->n_kv < 1 ||
        p->q_keep[0] < 0 || heads < 1 || p->q_keep[1] * dh > p->n_q || p->k_keep[0] < 0 ||
        p->k_keep[1] - p->k_keep[0] != p->n_kv || p->k_keep[1] * dh > p->n_k ||
        heads % p->n_kv || (p->skip_kv != 0 && p->skip_kv != 1))
        return step_fail("heads that do not fit the Q, K and V rows");
    if (rows_of(p->qkv, p->n_qkv) != p->n_q + (p->skip_kv ? 0 : p->n_k + p->n_v))
        return step_fail("Q, K and V matrices that do not give their rows");
    for (int i = 0; i < p->n_qkv; i++)
        if (p->qkv[i].k != l->d) return step_fail("a QKV matrix not of the model's width");
    if (p->out.rows != l->d || p->out.k != heads * dh)
        return step_fail("an output matrix not of the heads' width");
    if (p->n_gate_up > 0) {
        if (p->n_ff < 1 || rows_of(p->gate_up, p->n_gate_up) != 2 * p->n_ff ||
            p->down.rows != l->d || p->down.k != p->n_ff)
            return step_fail("FFN matrices that do not fit");
        for (int i = 0; i < p->n_gate_up; i++)
            if (p->gate_up[i].k != l->d) return step_fail("a gate/up matrix not of the width");
    }
    if (l->qk_norm == STEP_QK_NONE && (q_norm || k_norm)) return step_fail("a QK-norm unasked");
    return 1;
}

static void free_layer(step_layer *l) {
    for (int j = 0; j < 2; j++) free(l->parts[j].experts);
    free(l);
}

static void step_free(PyObject *capsule) {
    free_layer(PyCapsule_GetPointer(capsule, STEP_CAPSULE));
}

PyDoc_STRVAR(step_plan_doc,
             "step_plan(layer) -> plan: a layer's one-token step described once (quant.StepLayer, "
             "whose fields are in this order: addresses of weights the caller keeps alive).");

static PyObject *py_step_plan(PyObject *self, PyObject *args) {
    PyObject *parts;
    unsigned long long attn_norm, ffn_norm, post_attn, post_ffn, table, router;
    (void)self;
    step_layer *l = calloc(1, sizeof *l);
    if (l == NULL) return PyErr_NoMemory();
    if (!PyArg_ParseTuple(args, "(iiiiiiifKKKKKKiiO)", &l->d, &l->dh, &l->half, &l->neox,
                          &l->qk_norm, &l->window, &l->gelu, &l->eps, &attn_norm, &ffn_norm,
                          &post_attn, &post_ffn, &table, &router, &l->n_expert, &l->n_used,
                          &parts))
        goto fail;
    l->router = (const float *)(uintptr_t)router;
    if (l->router != NULL && (l->n_expert < 1 || l->n_expert > MAX_EXPERTS || l->n_used < 1 ||
                              l->n_used > l->n_expert || l->gelu)) {
        step_fail("routed experts: n_used of n_expert (at most 256), SwiGLU");
        goto fail;
    }
    l->attn_norm = (const float *)(uintptr_t)attn_norm;
    l->ffn_norm = (const float *)(uintptr_t)ffn_norm;
    l->post_attn = (const float *)(uintptr_t)post_attn;
    l->post_ffn = (const float *)(uintptr_t)post_ffn;
    l->gelu_table = (const float *)(uintptr_t)table;
    if (l->d < 1 || l->dh < 2 || l->dh % 2 || (l->half != 0 && l->half != 1) ||
        (l->neox != 0 && l->neox != 1) || l->qk_norm < STEP_QK_NONE ||
        l->qk_norm > STEP_QK_FULL || l->window < 0 || (l->gelu != 0 && l->gelu != 1) ||
        !attn_norm || !ffn_norm || (l->gelu && !table)) {
        step_fail("a layer's sizes or norms");
        goto fail;
    }
    if (!PyTuple_Check(parts) || PyTuple_GET_SIZE(parts) < 1 ||
        PyTuple_GET_SIZE(parts) > STEP_MAX_PARTS) {
        step_fail("1 to 16 parts (STEP_MAX_PARTS)");
        goto fail;
    }
    l->gelu16 = l->gelu && step_gelu16(l->gelu_table);
    l->n_parts = (int)PyTuple_GET_SIZE(parts);
    for (int j = 0; j < l->n_parts; j++)
        if (!parse_part(PyTuple_GET_ITEM(parts, j), l, &l->parts[j])) goto fail;
    if (l->parts[0].skip_kv) {
        step_fail("the first part computes its K and V");
        goto fail;
    }
    PyObject *capsule = PyCapsule_New(l, STEP_CAPSULE, step_free);
    if (capsule == NULL) goto fail;
    return capsule;
fail:
    free_layer(l);
    return NULL;
}

static const step_layer *plan_of(PyObject *capsule) {
    return PyCapsule_GetPointer(capsule, STEP_CAPSULE);
}

/* A part's cache (ctx, n_kv, dh) holding position pos, and rope tables (rows, dh / 2) with row
 * pos. */
static int check_cache(const step_layer *l, int j, const Py_buffer *k, const Py_buffer *v,
                       int pos) {
    const Py_ssize_t row = (Py_ssize_t)l->parts[j].n_kv * l->dh * (l->half ? 2 : 4);
    if (pos < 0 || k->len != v->len || k->len % row || k->len / row <= pos) {
        PyErr_Format(PyExc_ValueError, "step: caches of %zd and %zd bytes have no position %d "
                     "of %zd-byte rows", k->len, v->len, pos, row);
        return 0;
    }
    return 1;
}

static int check_tables(const step_layer *l, const Py_buffer *cos, const Py_buffer *sin,
                        int pos) {
    const Py_ssize_t row = (Py_ssize_t)(l->dh / 2) * 4;
    if (cos->len != sin->len || cos->len % row || cos->len / row <= pos) {
        PyErr_Format(PyExc_ValueError, "step: rope tables of %zd bytes have no position %d",
                     cos->len, pos);
        return 0;
    }
    return 1;
}

static float *step_alloc(const step_layer *l, int pos) {
    float *room = malloc(step_room(l, pos + 1) * sizeof(float));
    if (room == NULL) PyErr_NoMemory();
    return room;
}

/* x += the layer of plan `capsule` at pos, its parts' caches the items of the sequences kt, vt
 * and its rope tables cos_o, sin_o: step_whole with the buffers checked. 0, or -1 with an
 * exception set. */
static int run_layer(PyObject *capsule, Py_buffer *x, int pos, PyObject *kt, PyObject *vt,
                     PyObject *cos_o, PyObject *sin_o) {
    const step_layer *l = plan_of(capsule);
    if (l == NULL) return -1;
    Py_buffer k[STEP_MAX_PARTS], v[STEP_MAX_PARTS], cos, sin;
    int held = 0, tables = 0, rc = -1;
    PyObject *kf = PySequence_Fast(kt, "step_layer: caches as a sequence"), *vf = NULL;
    if (kf == NULL || (vf = PySequence_Fast(vt, "step_layer: caches as a sequence")) == NULL)
        goto done;
    if (PyObject_GetBuffer(cos_o, &cos, PyBUF_SIMPLE) < 0) goto done;
    if (PyObject_GetBuffer(sin_o, &sin, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&cos);
        goto done;
    }
    tables = 1;
    if (!fits("x", x, (Py_ssize_t)l->d * 4) || !check_tables(l, &cos, &sin, pos)) goto done;
    if (PySequence_Fast_GET_SIZE(kf) != l->n_parts || PySequence_Fast_GET_SIZE(vf) != l->n_parts) {
        PyErr_Format(PyExc_ValueError, "step_layer: %d parts need one cache each", l->n_parts);
        goto done;
    }
    for (int j = 0; j < l->n_parts; j++) {
        if (!l->parts[j].has_ffn) {
            PyErr_SetString(PyExc_ValueError, "step_layer: a part without a dense FFN");
            goto done;
        }
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(kf, j), &k[j], PyBUF_WRITABLE) < 0)
            goto done;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(vf, j), &v[j], PyBUF_WRITABLE) < 0) {
            PyBuffer_Release(&k[j]);
            goto done;
        }
        held++;
        if (!check_cache(l, j, &k[j], &v[j], pos)) goto done;
    }
    float *room = step_alloc(l, pos);
    if (room == NULL) goto done;
    void *kc[STEP_MAX_PARTS] = {NULL}, *vc[STEP_MAX_PARTS] = {NULL};
    for (int j = 0; j < held; j++) {
        kc[j] = k[j].buf;
        vc[j] = v[j].buf;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = step_whole(l, x->buf, pos, kc, vc, cos.buf, sin.buf, room);
    Py_END_ALLOW_THREADS
    free(room);
    if (rc < 0) PyErr_NoMemory();
done:
    for (int j = 0; j < held; j++) {
        PyBuffer_Release(&k[j]);
        PyBuffer_Release(&v[j]);
    }
    if (tables) {
        PyBuffer_Release(&cos);
        PyBuffer_Release(&sin);
    }
    Py_XDECREF(kf);
    Py_XDECREF(vf);
    return rc;
}

PyDoc_STRVAR(step_layer_doc,
             "step_layer(plan, x, pos, k_caches, v_caches, cos, sin): x (d float32) += the "
             "layer for the token at position pos, every part in turn (caches: one per part).");

static PyObject *py_step_layer(PyObject *self, PyObject *args) {
    PyObject *capsule, *kt, *vt, *cos, *sin;
    int pos;
    Py_buffer x;
    (void)self;
    if (!PyArg_ParseTuple(args, "Ow*iOOOO", &capsule, &x, &pos, &kt, &vt, &cos, &sin))
        return NULL;
    const int rc = run_layer(capsule, &x, pos, kt, vt, cos, sin);
    PyBuffer_Release(&x);
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

PyDoc_STRVAR(step_layers_doc,
             "step_layers(plans, x, pos, k_caches, v_caches, tables): step_layer for each plan "
             "in turn, layer i with k_caches[i], v_caches[i] and tables[i] = (cos, sin).");

static PyObject *py_step_layers(PyObject *self, PyObject *args) {
    PyObject *plans, *ks, *vs, *tables;
    int pos;
    Py_buffer x;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!w*iOOO!", &PyTuple_Type, &plans, &x, &pos, &ks, &vs,
                          &PyTuple_Type, &tables))
        return NULL;
    PyObject *kf = PySequence_Fast(ks, "step_layers: caches as a sequence"), *vf = NULL;
    int rc = -1;
    if (kf == NULL || (vf = PySequence_Fast(vs, "step_layers: caches as a sequence")) == NULL)
        goto done;
    const Py_ssize_t n = PyTuple_GET_SIZE(plans);
    if (PySequence_Fast_GET_SIZE(kf) != n || PySequence_Fast_GET_SIZE(vf) != n ||
        PyTuple_GET_SIZE(tables) != n) {
        PyErr_Format(PyExc_ValueError, "step_layers: %zd plans need caches and tables each", n);
        goto done;
    }
    rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        PyObject *t = PyTuple_GET_ITEM(tables, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2) {
            PyErr_SetString(PyExc_ValueError, "step_layers: tables of (cos, sin)");
            rc = -1;
            break;
        }
        rc = run_layer(PyTuple_GET_ITEM(plans, i), &x, pos, PySequence_Fast_GET_ITEM(kf, i),
                       PySequence_Fast_GET_ITEM(vf, i), PyTuple_GET_ITEM(t, 0),
                       PyTuple_GET_ITEM(t, 1));
    }
done:
    Py_XDECREF(kf);
    Py_XDECREF(vf);
    PyBuffer_Release(&x);
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

PyDoc_STRVAR(step_attn_doc,
             "step_attn(plan, j, h, pos, k_cache, v_cache, cos, sin, out): part j's ATTN "
             "partial (d float32) of the normed row h at position pos.");

static PyObject *py_step_attn(PyObject *self, PyObject *args) {
    PyObject *capsule;
    int j, pos;
    Py_buffer h, k, v, cos, sin, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oiy*iw*w*y*y*w*", &capsule, &j, &h, &pos, &k, &v, &cos, &sin,
                          &out))
        return NULL;
    const step_layer *l = plan_of(capsule);
    if (l == NULL || j < 0 || j >= (l ? l->n_parts : 0)) {
        if (l != NULL) PyErr_Format(PyExc_ValueError, "step_attn: no part %d", j);
        RELEASE_AND_RETURN(NULL, &h, &k, &v, &cos, &sin, &out);
    }
    if (!fits("h", &h, (Py_ssize_t)l->d * 4) || !fits("out", &out, (Py_ssize_t)l->d * 4) ||
        !check_cache(l, j, &k, &v, pos) || !check_tables(l, &cos, &sin, pos))
        RELEASE_AND_RETURN(NULL, &h, &k, &v, &cos, &sin, &out);
    float *room = step_alloc(l, pos);
    if (room == NULL) RELEASE_AND_RETURN(NULL, &h, &k, &v, &cos, &sin, &out);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = step_attn(l, j, h.buf, pos, k.buf, v.buf, cos.buf, sin.buf, out.buf, room);
    Py_END_ALLOW_THREADS
    free(room);
    if (rc < 0) {
        PyErr_NoMemory();
        RELEASE_AND_RETURN(NULL, &h, &k, &v, &cos, &sin, &out);
    }
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &h, &k, &v, &cos, &sin, &out);
}

PyDoc_STRVAR(step_ffn_doc, "step_ffn(plan, j, h, out): part j's dense FFN partial (d float32) "
                           "of the normed row h.");

static PyObject *py_step_ffn(PyObject *self, PyObject *args) {
    PyObject *capsule;
    int j;
    Py_buffer h, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oiy*w*", &capsule, &j, &h, &out)) return NULL;
    const step_layer *l = plan_of(capsule);
    if (l == NULL || j < 0 || j >= (l ? l->n_parts : 0) || !l->parts[j].has_ffn) {
        if (l != NULL) PyErr_Format(PyExc_ValueError, "step_ffn: no dense FFN in part %d", j);
        RELEASE_AND_RETURN(NULL, &h, &out);
    }
    if (!fits("h", &h, (Py_ssize_t)l->d * 4) || !fits("out", &out, (Py_ssize_t)l->d * 4))
        RELEASE_AND_RETURN(NULL, &h, &out);
    float *room = step_alloc(l, 0);
    if (room == NULL) RELEASE_AND_RETURN(NULL, &h, &out);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = step_ffn(l, j, h.buf, out.buf, room);
    Py_END_ALLOW_THREADS
    free(room);
    if (rc < 0) {
        PyErr_NoMemory();
        RELEASE_AND_RETURN(NULL, &h, &out);
    }
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &h, &out);
}

#if defined(FOUNDRY_X86)
static void detect_x86(int simd) {
    use_avx2 = simd && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    use_vnni = use_avx2 && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512vnni");
    use_512 = use_vnni && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
#endif

static PyObject *py_isa(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
#if defined(FOUNDRY_X86)
    return PyUnicode_FromString(use_512    ? "avx512-vnni"
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
        if (strcmp(name, "avx2") == 0) use_vnni = use_512 = 0;
    } else if (strcmp(name, "avx2+vnni") == 0) {
        detect_x86(1);
        if (!use_vnni) return PyErr_Format(PyExc_ValueError, "this CPU has no AVX-512 VNNI");
        use_512 = 0;
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
    if (n < 1 || n > 512) return PyErr_Format(PyExc_ValueError, "threads must be 1 .. 512, got %ld", n);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pool_set_threads((int)n);
    Py_END_ALLOW_THREADS
    if (rc < 0) return PyErr_Format(PyExc_OSError, "could not start %ld threads", n);
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

static PyMethodDef methods[] = {
    {"set_threads", py_set_threads, METH_O, set_threads_doc},
    {"threads", py_threads, METH_NOARGS, "The threads the kernels' pool runs on."},
    {"split_below", py_split_below, METH_O,
     "split_below(bytes): products of less work (weight bytes x inputs per thread) run on "
     "one thread (default 65536; tests set 0 to split tiny ones)."},
    {"matmul", py_matmul, METH_VARARGS, matmul_doc},
    {"dequantize", py_dequantize, METH_VARARGS, dequantize_doc},
    {"attend", py_attend, METH_VARARGS, attend_doc},
    {"attend_rows", py_attend_rows, METH_VARARGS, attend_rows_doc},
    {"rmsnorm", py_rmsnorm, METH_VARARGS, rmsnorm_doc},
    {"rope", py_rope, METH_VARARGS, rope_doc},
    {"swiglu", py_swiglu, METH_VARARGS, swiglu_doc},
    {"geglu", py_geglu, METH_VARARGS, geglu_doc},
    {"route", py_route, METH_VARARGS, route_doc},
    {"assign", py_assign, METH_VARARGS, assign_doc},
    {"combine", py_combine, METH_VARARGS, combine_doc},
    {"step_plan", py_step_plan, METH_VARARGS, step_plan_doc},
    {"step_layer", py_step_layer, METH_VARARGS, step_layer_doc},
    {"step_layers", py_step_layers, METH_VARARGS, step_layers_doc},
    {"step_attn", py_step_attn, METH_VARARGS, step_attn_doc},
    {"step_ffn", py_step_ffn, METH_VARARGS, step_ffn_doc},
    {"isa", py_isa, METH_NOARGS, "The instruction set the kernels use here."},
    {"use", py_use, METH_O,
     "use(path): 'best' (the default), 'avx2' (without VNNI) or 'portable' C (tests)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "Dot products over GGUF weight blocks (see foundry.model.kernels.quant).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    kernels_init();
#if defined(FOUNDRY_X86)
    __builtin_cpu_init();
    detect_x86(1);
#endif
    return PyModule_Create(&module);
}
