/* The Python interface of the one-token step (step.c; foundry.model.kernels._kernels). */

#include "py_kernels.h"

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
    if (!PyArg_ParseTuple(o, "OOOOiiiiiiiiiiKKKKKiO", &qkv, &out, &gate_up, &down, &p->n_q, &p->n_k,
                          &p->n_v, &p->n_kv, &p->n_ff, &p->q_keep[0], &p->q_keep[1], &p->k_keep[0],
                          &p->k_keep[1], &p->skip_kv, &bias[0], &bias[1], &bias[2], &q_norm,
                          &k_norm, &p->first_exp, &experts))
        return 0;
    /* A part without heads (a rank beyond the kv heads' groups: slices.kv_group_for) gives no
     * Q, K or V matrices and None for its output: its attention partial is zero. */
    const int no_heads = p->q_keep[1] == p->q_keep[0];
    if (!parse_mats(qkv, p->qkv, 3, &p->n_qkv) ||
        !parse_mats(gate_up, p->gate_up, 2, &p->n_gate_up))
        return 0;
    if (no_heads && out != Py_None) return step_fail("an output matrix for a part without heads");
    if (!no_heads && !parse_mat(out, &p->out)) return 0;
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
    if (no_heads) {
        if (p->n_qkv || p->n_q || p->n_k || p->n_v || p->n_kv || p->q_keep[0] < 0 ||
            p->k_keep[0] != p->k_keep[1] || p->skip_kv)
            return step_fail("a part without heads given Q, K or V rows");
    } else if (p->n_q % dh || p->n_k % dh || p->n_v != p->n_kv * dh || p->n_kv < 1 ||
               p->q_keep[0] < 0 || heads < 1 || p->q_keep[1] * dh > p->n_q || p->k_keep[0] < 0 ||
               p->k_keep[1] - p->k_keep[0] != p->n_kv || p->k_keep[1] * dh > p->n_k ||
               heads % p->n_kv || (p->skip_kv != 0 && p->skip_kv != 1))
        return step_fail("heads that do not fit the Q, K and V rows");
    else if (rows_of(p->qkv, p->n_qkv) != p->n_q + (p->skip_kv ? 0 : p->n_k + p->n_v))
        return step_fail("Q, K and V matrices that do not give their rows");
    for (int i = 0; i < p->n_qkv; i++)
        if (p->qkv[i].k != l->d) return step_fail("a QKV matrix not of the model's width");
    if (!no_heads && (p->out.rows != l->d || p->out.k != heads * dh))
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
    for (int j = 0; j < STEP_MAX_PARTS; j++) free(l->parts[j].experts);
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
                          &post_attn, &post_ffn, &table, &router, &l->n_expert, &l->n_used, &parts))
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
        (l->neox != 0 && l->neox != 1) || l->qk_norm < STEP_QK_NONE || l->qk_norm > STEP_QK_FULL ||
        l->window < 0 || (l->gelu != 0 && l->gelu != 1) || !attn_norm || !ffn_norm ||
        (l->gelu && !table)) {
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
    if (row == 0 && pos >= 0 && k->len == 0 && v->len == 0) return 1; /* a part without heads */
    if (pos < 0 || row == 0 || k->len != v->len || k->len % row || k->len / row <= pos) {
        PyErr_Format(PyExc_ValueError,
                     "step: caches of %zd and %zd bytes have no position %d "
                     "of %zd-byte rows",
                     k->len, v->len, pos, row);
        return 0;
    }
    return 1;
}

static int check_tables(const step_layer *l, const Py_buffer *cos, const Py_buffer *sin, int pos) {
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

/* A rank's gates through Python: the partial copied into `gate` (d floats, the Python side's
 * array), hook(layer, gate_index) called with the GIL taken (it exchanges the array for the
 * world's total in place), the total copied back. */
typedef struct {
    PyObject *hook;
    float *gate;
    int d;
} py_gate;

static int py_gate_exchange(void *ctx, int layer, int gate, float *sum) {
    const py_gate *g = ctx;
    memcpy(g->gate, sum, (size_t)g->d * sizeof(float));
    PyGILState_STATE held = PyGILState_Ensure();
    PyObject *r = PyObject_CallFunction(g->hook, "ii", layer, gate);
    Py_XDECREF(r);
    PyGILState_Release(held);
    if (r == NULL) return -1; /* its exception stays set on this thread */
    memcpy(sum, g->gate, (size_t)g->d * sizeof(float));
    return 0;
}

/* x += the layer of plan `capsule` at pos, its parts' caches the items of the sequences kt, vt
 * and its rope tables cos_o, sin_o: step_whole with the buffers checked; with `xch` (a rank of
 * a world), each gate's partial exchanged through it. 0, or -1 with an exception set. */
static int run_layer(PyObject *capsule, Py_buffer *x, int pos, PyObject *kt, PyObject *vt,
                     PyObject *cos_o, PyObject *sin_o, const step_exchange *xch) {
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
    Py_BEGIN_ALLOW_THREADS rc = step_whole(l, x->buf, pos, kc, vc, cos.buf, sin.buf, room, xch);
    Py_END_ALLOW_THREADS free(room);
    if (rc == STEP_EXCHANGE) {
        rc = -1; /* a hook's exception is set; a native exchange keeps what failed */
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ConnectionError, "step_layers: a gate exchange failed");
    } else if (rc < 0)
        PyErr_NoMemory();
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
    if (!PyArg_ParseTuple(args, "Ow*iOOOO", &capsule, &x, &pos, &kt, &vt, &cos, &sin)) return NULL;
    const int rc = run_layer(capsule, &x, pos, kt, vt, cos, sin, NULL);
    PyBuffer_Release(&x);
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

PyDoc_STRVAR(step_layers_doc,
             "step_layers(plans, x, pos, k_caches, v_caches, tables, hook=None, gate=None): "
             "step_layer for each plan in turn, layer i with k_caches[i], v_caches[i] and "
             "tables[i] = (cos, sin). With hook (a rank of a world), each gate's partial is "
             "copied into gate (d float32), hook(layer, gate_index) called to replace it with "
             "the world's total in place, and the total used; the GIL is let go between gates. "
             "hook may instead be a capsule named 'foundry.step_exchange' (step_exchange.h; "
             "gate then unused): the gates run in C, and a failed one raises ConnectionError, "
             "what failed kept by the capsule's owner.");

static PyObject *py_step_layers(PyObject *self, PyObject *args) {
    PyObject *plans, *ks, *vs, *tables, *hook = Py_None;
    int pos;
    Py_buffer x, gate_buf = {0};
    (void)self;
    if (!PyArg_ParseTuple(args, "O!w*iOOO!|Ow*", &PyTuple_Type, &plans, &x, &pos, &ks, &vs,
                          &PyTuple_Type, &tables, &hook, &gate_buf))
        return NULL;
    PyObject *kf = PySequence_Fast(ks, "step_layers: caches as a sequence"), *vf = NULL;
    py_gate gate = {hook, gate_buf.buf, 0};
    step_exchange xch = {py_gate_exchange, NULL, NULL, &gate, 0, 0, 0, 0};
    int rc = -1;
    if (PyCapsule_IsValid(hook, STEP_EXCHANGE_CAPSULE)) {
        xch = *(const step_exchange *)PyCapsule_GetPointer(hook, STEP_EXCHANGE_CAPSULE);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(plans); i++) {
            const step_layer *l = plan_of(PyTuple_GET_ITEM(plans, i));
            if (l == NULL) goto done;
            if (l->d != xch.d) {
                PyErr_Format(PyExc_ValueError,
                             "step_layers: the exchange's gates are %d floats, "
                             "layer %zd's %d",
                             xch.d, i, l->d);
                goto done;
            }
        }
    } else if (hook != Py_None) {
        if (!PyCallable_Check(hook) || gate_buf.buf == NULL) {
            PyErr_SetString(PyExc_TypeError, "step_layers: a callable hook and its gate buffer");
            goto done;
        }
        if (PyTuple_GET_SIZE(plans) > 0) {
            const step_layer *l0 = plan_of(PyTuple_GET_ITEM(plans, 0));
            if (l0 == NULL || !fits("gate", &gate_buf, (Py_ssize_t)l0->d * 4)) goto done;
            gate.d = l0->d;
        }
    }
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
        xch.layer = (int)i;
        rc = run_layer(PyTuple_GET_ITEM(plans, i), &x, pos, PySequence_Fast_GET_ITEM(kf, i),
                       PySequence_Fast_GET_ITEM(vf, i), PyTuple_GET_ITEM(t, 0),
                       PyTuple_GET_ITEM(t, 1), hook != Py_None ? &xch : NULL);
    }
done:
    Py_XDECREF(kf);
    Py_XDECREF(vf);
    PyBuffer_Release(&x);
    if (gate_buf.obj != NULL) PyBuffer_Release(&gate_buf);
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
    Py_BEGIN_ALLOW_THREADS rc =
        step_attn(l, j, h.buf, pos, k.buf, v.buf, cos.buf, sin.buf, out.buf, room);
    Py_END_ALLOW_THREADS free(room);
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
    Py_BEGIN_ALLOW_THREADS rc = step_ffn(l, j, h.buf, out.buf, room);
    Py_END_ALLOW_THREADS free(room);
    if (rc < 0) {
        PyErr_NoMemory();
        RELEASE_AND_RETURN(NULL, &h, &out);
    }
    RELEASE_AND_RETURN(Py_NewRef(Py_None), &h, &out);
}

PyMethodDef step_methods[] = {
    {"step_plan", py_step_plan, METH_VARARGS, step_plan_doc},
    {"step_layer", py_step_layer, METH_VARARGS, step_layer_doc},
    {"step_layers", py_step_layers, METH_VARARGS, step_layers_doc},
    {"step_attn", py_step_attn, METH_VARARGS, step_attn_doc},
    {"step_ffn", py_step_ffn, METH_VARARGS, step_ffn_doc},
    {NULL, NULL, 0, NULL},
};
