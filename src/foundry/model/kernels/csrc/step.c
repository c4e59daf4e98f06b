/* One token through a layer in one call: the decode step's operations of inference.Engine's
 * Python path (forward_rows with one row), the same routines in the same order, so the bits are
 * the same (the tensor-parallel pair adds its parts' partials p0 + p1 at each gate, and one
 * process must equal it bit for bit: a part here is computed as the pair's rank computes it). */

#include "kernels.h"

#include <stdatomic.h>

/* ---- helpers ------------------------------------------------------------------------------ */

/* y (rows) = m . x over the matrices of a product, each filling its rows in turn (a stacked
 * QKV or gate/up gives the same bits as its pieces: every row is its own dot product). */
static int products(const step_mat *m, int n_mats, const float *x, float *y) {
    for (int i = 0; i < n_mats; i++) {
        if (matmul(m[i].type, m[i].w, m[i].row_bytes, m[i].rows, m[i].k, x, 1, y) < 0) return -1;
        y += m[i].rows;
    }
    return 0;
}

/* ---- a rank's gate products, sent as they are made ------------------------------------------ */

/* The most products the peers' chunks of a gate's product are cut into (each one pool call);
 * this rank's own chunk is one more, the last. */
#define POST_PIECES 3

static int posts(const step_exchange *xch) {
    return xch != NULL && xch->begin != NULL && xch->world > 1;
}

/* The first row of chunk c of d rows cut into `world` (the exchange's chunks). */
static int chunk_row(int c, int d, int world) {
    return (int)((int64_t)c * d / world);
}

/* y (d floats) = m . x, the partial of gate `gate`. With an exchange that posts (a rank of a
 * world; x NULL there: zero, a part without heads), the peers' chunks first, in the order
 * rank + 1, ..., rank - 1, each piece posted as soon as its rows are in, then this rank's own
 * chunk; so the peers' pieces are on the wire while the rest is computed. Every row is its own
 * dot product, so the bits are the one product's. */
static int gate_product(int d, const step_mat *m, const float *x, float *y,
                        const step_exchange *xch, int gate) {
    if (!posts(xch)) return matmul(m->type, m->w, m->row_bytes, m->rows, m->k, x, 1, y);
    const int world = xch->world, rank = xch->rank, others = world - 1;
    const int pieces = others < POST_PIECES ? others : POST_PIECES;
    xch->begin(xch->ctx, xch->layer, gate, y);
    for (int g = 0, i = 0; g <= pieces; g++) {
        const int first = i, end = g < pieces ? (g + 1) * others / pieces : world;
        while (i < end) { /* a run of chunks whose rows are contiguous (up to the last one) */
            const int c = (rank + 1 + i) % world;
            int n = 1;
            while (i + n < end && c + n < world) n++;
            const int lo = chunk_row(c, d, world), hi = chunk_row(c + n, d, world);
            if (x == NULL)
                memset(y + lo, 0, (size_t)(hi - lo) * sizeof *y);
            else if (hi > lo && matmul(m->type, m->w + (size_t)lo * m->row_bytes, m->row_bytes,
                                       hi - lo, m->k, x, 1, y + lo) < 0)
                return -1;
            i += n;
        }
        if (g < pieces)
            for (int j = first; j < end; j++) xch->post(xch->ctx, (rank + 1 + j) % world);
    }
    return 0;
}

/* ---- one part's ATTN partial ---------------------------------------------------------------- */

/* Room for one part's Q, K and V rows (floats): the products, the norms' outputs, K turned. */
static size_t qkv_room(const step_part *p, int dh) {
    return 2 * ((size_t)p->n_q + p->n_k) + p->n_v + (size_t)p->n_kv * dh;
}

/* Part j's kept Q heads, normed and turned, into q (heads x dh); its K and V row written to the
 * caches at pos (unless the part before wrote the same row: skip_kv). Engine._attention up to
 * the attention itself. ``have_y``: the room begins with the part's Q, K and V products
 * already (qkv_parts computed them). */
static int attn_rows(const step_layer *l, int j, const float *h, int pos, void *kc, void *vc,
                     const float *cos, const float *sin, float *q, float *room, int have_y) {
    const step_part *p = &l->parts[j];
    const int dh = l->dh, half = dh / 2;
    const int heads = p->q_keep[1] - p->q_keep[0], kv = p->k_keep[1] - p->k_keep[0];
    float *y = room, *qn = y + p->n_q + p->n_k + p->n_v, *kn = qn + p->n_q, *k = kn + p->n_k;
    if (!have_y && products(p->qkv, p->n_qkv, h, y) < 0) return -1;
    float *yq = y, *yk = y + p->n_q, *yv = y + p->n_q + p->n_k;
    if (p->bias[0] != NULL) {
        for (int i = 0; i < p->n_q; i++) yq[i] = yq[i] + p->bias[0][i];
        if (!p->skip_kv) {
            for (int i = 0; i < p->n_k; i++) yk[i] = yk[i] + p->bias[1][i];
            for (int i = 0; i < p->n_v; i++) yv[i] = yv[i] + p->bias[2][i];
        }
    }
    /* Engine._qk: the whole-vector norm, the kept heads, the per-head norm */
    const float *qs = yq, *ks = yk;
    if (l->qk_norm == STEP_QK_FULL && p->q_norm != NULL) {
        rmsnorm(yq, p->q_norm, 1, p->n_q, l->eps, qn);
        qs = qn;
    }
    if (!p->skip_kv && l->qk_norm == STEP_QK_FULL && p->k_norm != NULL) {
        rmsnorm(yk, p->k_norm, 1, p->n_k, l->eps, kn);
        ks = kn;
    }
    qs += (size_t)p->q_keep[0] * dh;
    ks += (size_t)p->k_keep[0] * dh;
    if (l->qk_norm == STEP_QK_HEAD && p->q_norm != NULL) {
        rmsnorm(qs, p->q_norm, heads, dh, l->eps, qn);
        qs = qn;
    }
    if (!p->skip_kv && l->qk_norm == STEP_QK_HEAD && p->k_norm != NULL) {
        rmsnorm(ks, p->k_norm, kv, dh, l->eps, kn);
        ks = kn;
    }
    const float *c = cos + (size_t)pos * half, *s = sin + (size_t)pos * half;
    rope(qs, c, s, 1, heads, dh, l->neox, q);
    if (p->skip_kv) return 0; /* the part before wrote this row of the cache they share */
    rope(ks, c, s, 1, kv, dh, l->neox, k);
    const size_t stride = (size_t)p->n_kv * dh;
    if (l->half) {
        uint16_t *k16 = (uint16_t *)kc + (size_t)pos * stride,
                 *v16 = (uint16_t *)vc + (size_t)pos * stride;
        for (size_t i = 0; i < stride; i++) {
            k16[i] = half_bits(k[i]);
            v16[i] = half_bits(yv[i]);
        }
    } else {
        memcpy((float *)kc + (size_t)pos * stride, k, stride * 4);
        memcpy((float *)vc + (size_t)pos * stride, yv, stride * 4);
    }
    return 0;
}

/* The attention at pos of `count` blocks of heads over the layer's window (attend_many in one
 * pool call): each item's k and v given at position 0 of its cache, moved here to the window's
 * first position. */
static int attend_window(const step_layer *l, attend_item *items, int count, int pos) {
    const size_t size = l->half ? 2 : 4;
    const int n_pos = pos + 1, first = l->window && n_pos > l->window ? n_pos - l->window : 0;
    for (int j = 0; j < count; j++) {
        const size_t at = (size_t)first * items[j].n_kv * l->dh * size;
        items[j].k = (const uint8_t *)items[j].k + at;
        items[j].v = (const uint8_t *)items[j].v + at;
    }
    return attend_many(items, count, l->half, n_pos - first, l->dh);
}

/* o (heads x dh) = the attention of q's heads at pos over the window (``attend``). */
static int attn_heads(const step_layer *l, int n_kv, int heads, const float *q, int pos,
                      const void *kc, const void *vc, float *o) {
    attend_item item = {q, kc, vc, heads, n_kv, o};
    return attend_window(l, &item, 1, pos);
}

static int heads_of(const step_part *p) {
    return p->q_keep[1] - p->q_keep[0];
}

/* Every part's attention (attn_heads of each) in one pool call: part j's q[j] into o[j]. */
static int attn_heads_parts(const step_layer *l, float *const *q, int pos, void *const *kc,
                            void *const *vc, float *const *o) {
    attend_item items[STEP_MAX_PARTS];
    int n = 0;
    for (int j = 0; j < l->n_parts; j++) {
        const step_part *p = &l->parts[j];
        if (heads_of(p)) items[n++] = (attend_item){q[j], kc[j], vc[j], heads_of(p), p->n_kv, o[j]};
    }
    return n ? attend_window(l, items, n, pos) : 0;
}

int step_attn(const step_layer *l, int j, const float *h, int pos, void *kc, void *vc,
              const float *cos, const float *sin, float *out, float *room) {
    const step_part *p = &l->parts[j];
    if (!heads_of(p)) { /* a part without heads: its partial is zero */
        memset(out, 0, (size_t)l->d * sizeof *out);
        return 0;
    }
    const size_t hd = (size_t)heads_of(p) * l->dh;
    float *q = room, *o = q + hd, *rest = o + hd;
    if (attn_rows(l, j, h, pos, kc, vc, cos, sin, q, rest, 0) < 0) return -1;
    if (attn_heads(l, p->n_kv, heads_of(p), q, pos, kc, vc, o) < 0) return -1;
    return matmul(p->out.type, p->out.w, p->out.row_bytes, p->out.rows, p->out.k, o, 1, out);
}

/* ---- GELU of the FFN ---------------------------------------------------------------------------
 */

/* The GELU table's values are float16 values (arch.gelu_table rounds them): kept as their
 * float16 bits they take half the cache lines, which the streamed weights keep evicting
 * between two layers (the lookups of one row were most of geglu's time). Filled once from the
 * float32 table, if every value geglu can look up (|x| < 10, or NaN) is a float16 exactly. */
static uint16_t gelu16[65536 + 2]; /* + 2: a 32-bit load of the last entry */
static int gelu16_ready;

int step_gelu16(const float *table) {
    uint16_t copy[65536];
    for (int c = 0; c < 65536; c++) {
        const float x = f16_table[c], t = table[c];
        copy[c] = f16_bits(t);
        if (x != x) { /* a NaN looks up its own code in geglu, F16C's code here: the same value */
            if (memcmp(&t, &table[0x7E00 | (c & 0x8000)], 4) != 0) return 0;
        } else if (fabsf(x) >= 10.0f) {
            continue; /* never looked up */
        }
        if (memcmp(&f16_table[copy[c]], &t, 4) != 0) return 0;
    }
    if (gelu16_ready) /* filled from the same table (arch.gelu_table is built once) */
        return memcmp(copy, gelu16, sizeof copy) == 0;
    memcpy(gelu16, copy, sizeof copy);
    gelu16_ready = 1;
    return 1;
}

#if defined(FOUNDRY_X86)
/* geglu (decode.c) with the float16 bits of g by F16C (round to nearest even: f16_bits, and a
 * NaN's bits, whichever, look up 0) and the table's float16 value converted exactly. */
AVX2 void geglu16_avx2(const float *gu, int f, float *out) {
    const float *g = gu, *u = gu + f;
    for (int i = 0; i < f; i++) {
        const float x = g[i];
        const float act =
            x <= -10.0f ? 0.0f : (x >= 10.0f ? x : _cvtsh_ss(gelu16[_cvtss_sh(x, 0)]));
        out[i] = act * u[i];
    }
}
#endif

/* The table geglu's rows last found equal to the float16 copy (step_gelu16), so that a block's
 * rows take geglu16_avx2 too without checking its 65,536 values at every call: the engine
 * passes the process's one table (layers.gelu_table, built once and kept). */
static const float *_Atomic gelu16_table;

int gelu16_for(const float *table) {
    if (atomic_load_explicit(&gelu16_table, memory_order_acquire) == table) return 1;
    if (!step_gelu16(table)) return 0;
    atomic_store_explicit(&gelu16_table, table, memory_order_release);
    return 1;
}

static void geglu_row(const step_layer *l, const float *gu, int f, float *out) {
#if defined(FOUNDRY_X86)
    if (use_avx2 && l->gelu16) {
        geglu16_avx2(gu, f, out);
        return;
    }
#endif
    geglu(gu, l->gelu_table, 1, f, out);
}

/* ---- one part's FFN partial (dense) ---------------------------------------------------------- */

/* out (d) = down(act(gate h) * up h): a dense FFN, or one routed expert (SwiGLU). */
static int glu(const step_layer *l, const step_mat *gate_up, int n_gate_up, const step_mat *down,
               const float *h, float *out, float *room, const step_exchange *xch) {
    const int f = down->k;
    float *gu = room, *a = gu + 2 * (size_t)f;
    if (products(gate_up, n_gate_up, h, gu) < 0) return -1;
    if (l->gelu)
        geglu_row(l, gu, f, a);
    else
        swiglu(gu, 1, f, a);
    return gate_product(l->d, down, a, out, xch, 1);
}

/* The routed experts of parts j0 .. j1 - 1 for the row h (Engine._ffn for one row, each part in
 * turn): the row's n_used experts and weights (route), each part's own among them through
 * its SwiGLU (assign groups them by expert, one row each), and each part's weighted sum of
 * its experts' outputs in the order of the row's choices, another part's expert adding 0
 * (combine), into outs[j - j0]. The experts' gate and up products of all these parts run in
 * one pool call, then their down products in another: every output row is computed as the
 * one-expert code computes it. */
static int routed_parts(const step_layer *l, int j0, int j1, const float *h, float *const *outs,
                        float *room) {
    const int d = l->d, k = l->n_used;
    float weights[MAX_EXPERTS];
    int64_t top[MAX_EXPERTS], slot[2][MAX_EXPERTS];
    route(h, l->router, 1, d, l->n_expert, k, weights, top);
    const step_expert *chosen[2 * MAX_EXPERTS];
    int m = 0;
    for (int j = j0; j < j1; j++) {
        const step_part *p = &l->parts[j];
        for (int c = 0; c < k; c++) {
            const int64_t e = top[c] - p->first_exp;
            slot[j - j0][c] = -1;
            if (e < 0 || e >= p->n_exp) continue;
            chosen[m] = &p->experts[e];
            slot[j - j0][c] = m++; /* the part's row of ys: its own experts are numbered from 0 */
        }
    }
    /* room: every chosen expert's output (d), then its gate and up (2f) and activation (f) */
    float *ys = room, *act = ys + (size_t)m * d;
    mm_item list[2 * MAX_EXPERTS * 2];
    float *gu[2 * MAX_EXPERTS], *a[2 * MAX_EXPERTS];
    int n = 0;
    for (int i = 0; i < m; i++) {
        const step_expert *x = chosen[i];
        const int f = x->down.k;
        gu[i] = act;
        a[i] = act + 2 * (size_t)f;
        act = a[i] + f;
        float *y = gu[i];
        for (int g = 0; g < x->n_gate_up; g++) {
            const step_mat *w = &x->gate_up[g];
            list[n++] = (mm_item){w->type, w->rows, w->k, w->row_bytes, w->w, h, y};
            y += w->rows;
        }
    }
    if (matmul_many(list, n) < 0) return -1;
    n = 0;
    for (int i = 0; i < m; i++) {
        const step_mat *w = &chosen[i]->down;
        swiglu(gu[i], 1, w->k, a[i]);
        list[n++] = (mm_item){w->type, w->rows, w->k, w->row_bytes, w->w, a[i], ys + (size_t)i * d};
    }
    if (matmul_many(list, n) < 0) return -1;
    int base = 0;
    for (int j = j0; j < j1; j++) {
        int own = 0;
        for (int c = 0; c < k; c++)
            if (slot[j - j0][c] >= 0) {
                slot[j - j0][c] -= base;
                own++;
            }
        combine(ys + (size_t)base * d, weights, slot[j - j0], 1, k, d, outs[j - j0]);
        base += own;
    }
    return 0;
}

static int routed(const step_layer *l, int j, const float *h, float *out, float *room) {
    return routed_parts(l, j, j + 1, h, &out, room);
}

int step_ffn(const step_layer *l, int j, const float *h, float *out, float *room) {
    const step_part *p = &l->parts[j];
    if (l->router != NULL) return routed(l, j, h, out, room);
    return glu(l, p->gate_up, p->n_gate_up, &p->down, h, out, room, NULL);
}

size_t step_room(const step_layer *l, int n_pos) {
    size_t most = 0, heads = 0, qkv_all = 0;
    int n_kv = 0;
    for (int j = 0; j < l->n_parts; j++) {
        const step_part *p = &l->parts[j];
        size_t f = 3 * (size_t)p->n_ff;
        for (int e = 0; e < p->n_exp; e++) { /* routed: every part's chosen experts' outputs
                                              * and gate, up and activation (routed_parts) */
            const size_t fe =
                (size_t)l->n_parts * l->n_used * ((size_t)l->d + 3 * (size_t)p->experts[e].down.k);
            f = fe > f ? fe : f;
        }
        const size_t a = qkv_room(p, l->dh);
        qkv_all += a; /* step_whole: every part's products at once */
        most = a > most ? a : most;
        most = f > most ? f : most;
        heads += heads_of(p);
        n_kv = p->n_kv > n_kv ? p->n_kv : n_kv;
    }
    most = qkv_all > most ? qkv_all : most;
    /* + the heads' Q and outputs, attend's scores and row; h, a partial, the sum, a norm */
    return most + 2 * heads * l->dh + heads * n_pos + (size_t)n_kv * l->dh + 4 * (size_t)l->d;
}

/* ---- the whole layer, every part in this process (no exchange) ------------------------------ */

/* Whether the parts attend over one shared cache of one kv head (a replicated kv head): every
 * head then reads kv head 0 whichever part it is in, and attend's heads are independent of one
 * another (each its own scores, softmax and sums), so one pass over the cache for all the
 * parts' heads gives each head the bits of its part's own pass. */
static int one_pass(const step_layer *l) {
    return l->n_parts == 2 && l->parts[1].skip_kv && l->parts[0].n_kv == 1 && l->parts[1].n_kv == 1;
}

/* Every part's Q, K and V products of h in one pool call, part j's into ys[j]. */
static int qkv_parts(const step_layer *l, const float *h, float *const *ys) {
    mm_item list[6];
    int n = 0;
    for (int j = 0; j < l->n_parts; j++) {
        const step_part *p = &l->parts[j];
        float *y = ys[j];
        for (int i = 0; i < p->n_qkv; i++) {
            const step_mat *w = &p->qkv[i];
            list[n++] = (mm_item){w->type, w->rows, w->k, w->row_bytes, w->w, h, y};
            y += w->rows;
        }
    }
    return matmul_many(list, n);
}

/* Every part's output product in one pool call: part j's of os[j] into outs[j]; a rank's one
 * part through gate_product (posted as it goes). */
static int out_parts(const step_layer *l, float *const *os, float *const *outs,
                     const step_exchange *xch) {
    if (l->n_parts == 1 && posts(xch)) {
        const step_part *p = &l->parts[0];
        return gate_product(l->d, &p->out, heads_of(p) ? os[0] : NULL, outs[0], xch, 0);
    }
    mm_item list[2];
    int n = 0;
    for (int j = 0; j < l->n_parts; j++) {
        const step_mat *w = &l->parts[j].out;
        if (heads_of(&l->parts[j]))
            list[n++] = (mm_item){w->type, w->rows, w->k, w->row_bytes, w->w, os[j], outs[j]};
        else /* a part without heads: its partial is zero */
            memset(outs[j], 0, (size_t)l->d * sizeof *outs[j]);
    }
    return n ? matmul_many(list, n) : 0;
}

/* x (d) += the layer: forward_rows' loop body for one row. With xch, each gate's sum of this
 * process's parts is exchanged for the world's total before the post-norm and the residual
 * add (a rank of a world: its one part); without, the parts' sum is the total. */
int step_whole(const step_layer *l, float *x, int pos, void *const *kc, void *const *vc,
               const float *cos, const float *sin, float *room, const step_exchange *xch) {
    const int d = l->d;
    float *h = room, *part = h + d, *sum = part + d, *normed = sum + d, *rest = normed + d;
    PROF_START(layer);
    for (int gate = 0; gate < 2; gate++) {
        PROF_START(phase);
        rmsnorm(x, gate ? l->ffn_norm : l->attn_norm, 1, d, l->eps, h);
        if (!gate && one_pass(l)) {
            const size_t h0 = (size_t)heads_of(&l->parts[0]) * l->dh,
                         hd = h0 + (size_t)heads_of(&l->parts[1]) * l->dh;
            float *q = rest, *o = q + hd, *y0 = o + hd, *y1 = y0 + qkv_room(&l->parts[0], l->dh);
            float *ys[2] = {y0, y1}, *os[2] = {o, o + h0}, *outs[2] = {sum, part};
            if (qkv_parts(l, h, ys) < 0) return -1;
            PROF_STOP(phase, PROF_QKV);
            PROF_START(attn);
            for (int j = 0; j < 2; j++)
                if (attn_rows(l, j, h, pos, kc[j], vc[j], cos, sin, q + (j ? h0 : 0), ys[j], 1) < 0)
                    return -1;
            if (attn_heads(l, 1, (int)(hd / l->dh), q, pos, kc[0], vc[0], o) < 0) return -1;
            PROF_STOP(attn, PROF_ATTN);
            PROF_START(out);
            if (out_parts(l, os, outs, NULL) < 0) return -1;
            PROF_STOP(out, PROF_OUT);
            for (int i = 0; i < d; i++) sum[i] = sum[i] + part[i];
        } else if (!gate && l->n_parts <= 2) { /* every part's Q, K, V in one pool call */
            float *q[2], *o[2], *ys[2], *outs[2] = {sum, part}, *at = rest;
            for (int j = 0; j < l->n_parts; j++) {
                const size_t hd = (size_t)heads_of(&l->parts[j]) * l->dh;
                q[j] = at;
                o[j] = q[j] + hd;
                at = o[j] + hd;
            }
            for (int j = 0; j < l->n_parts; j++) {
                ys[j] = at;
                at += qkv_room(&l->parts[j], l->dh);
            }
            if (qkv_parts(l, h, ys) < 0) return -1;
            PROF_STOP(phase, PROF_QKV);
            PROF_START(attn);
            for (int j = 0; j < l->n_parts; j++)
                if (heads_of(&l->parts[j]) &&
                    attn_rows(l, j, h, pos, kc[j], vc[j], cos, sin, q[j], ys[j], 1) < 0)
                    return -1;
            if (attn_heads_parts(l, q, pos, kc, vc, o) < 0) return -1;
            PROF_STOP(attn, PROF_ATTN);
            PROF_START(out);
            if (out_parts(l, o, outs, xch) < 0) return -1;
            PROF_STOP(out, PROF_OUT);
            if (l->n_parts == 2) /* _sum: the partials added in rank order */
                for (int i = 0; i < d; i++) sum[i] = sum[i] + part[i];
        } else if (!gate) { /* more parts than the batched calls hold: each part in turn */
            for (int j = 0; j < l->n_parts; j++) {
                if (step_attn(l, j, h, pos, kc[j], vc[j], cos, sin, j ? part : sum, rest) < 0)
                    return -1;
                if (j) /* _sum: the partials added in rank order */
                    for (int i = 0; i < d; i++) sum[i] = sum[i] + part[i];
            }
        } else if (l->router != NULL && l->n_parts <= 2) { /* every part's experts, 2 calls */
            float *outs[2] = {sum, part};
            if (routed_parts(l, 0, l->n_parts, h, outs, rest) < 0) return -1;
            if (l->n_parts == 2) /* _sum: the partials added in rank order */
                for (int i = 0; i < d; i++) sum[i] = sum[i] + part[i];
            PROF_STOP(phase, PROF_FFN);
        } else if (l->n_parts == 1 && l->router == NULL) { /* its down product posted */
            const step_part *p = &l->parts[0];
            if (glu(l, p->gate_up, p->n_gate_up, &p->down, h, sum, rest, xch) < 0) return -1;
            PROF_STOP(phase, PROF_FFN);
        } else {
            for (int j = 0; j < l->n_parts; j++) {
                const int rc = step_ffn(l, j, h, j ? part : sum, rest);
                if (rc < 0) return -1;
                if (j) /* _sum: the partials added in rank order */
                    for (int i = 0; i < d; i++) sum[i] = sum[i] + part[i];
            }
            PROF_STOP(phase, PROF_FFN);
        }
        if (xch != NULL && xch->fn(xch->ctx, xch->layer, gate, sum) < 0) return STEP_EXCHANGE;
        const float *post = gate ? l->post_ffn : l->post_attn, *add = sum;
        if (post != NULL) {
            rmsnorm(sum, post, 1, d, l->eps, normed);
            add = normed;
        }
        for (int i = 0; i < d; i++) x[i] = x[i] + add[i];
    }
    PROF_STOP(layer, PROF_LAYER);
    return 0;
}
