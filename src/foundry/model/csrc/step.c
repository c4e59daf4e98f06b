/* One token through a layer in one call: the decode step's operations of inference.Engine's
 * Python path (forward_rows with one row), the same routines in the same order, so the bits are
 * the same (the tensor-parallel pair adds its parts' partials p0 + p1 at each gate, and one
 * process must equal it bit for bit: a part here is computed as the pair's rank computes it). */

#include "kernels.h"

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

/* float32 to the float16 bits numpy's astype(float16) gives: round to nearest even (f16_bits),
 * and a NaN as numpy keeps it (its payload's top ten bits, at least 1, the sign). */
static inline uint16_t half_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        const uint32_t payload = (u & 0x7FFFFFu) >> 13;
        return (uint16_t)(((u >> 16) & 0x8000u) | 0x7C00u | (payload ? payload : 1u));
    }
    return f16_bits(x);
}

/* ---- one part's ATTN partial ---------------------------------------------------------------- */

/* Room for one part's attention at n_pos positions (floats). */
static size_t attn_room(const step_part *p, int n_pos, int dh) {
    const size_t heads = (size_t)(p->q_keep[1] - p->q_keep[0]);
    return (size_t)p->n_q + p->n_k + p->n_v + p->n_q + p->n_k + 2 * heads * dh +
           (size_t)p->n_kv * dh + heads * n_pos + (size_t)p->n_kv * dh;
}

int step_attn(const step_layer *l, int j, const float *h, int pos, void *kc, void *vc,
              const float *cos, const float *sin, float *out, float *room) {
    const step_part *p = &l->parts[j];
    const int dh = l->dh, half = dh / 2;
    const int heads = p->q_keep[1] - p->q_keep[0], kv = p->k_keep[1] - p->k_keep[0];
    float *y = room, *qn = y + p->n_q + p->n_k + p->n_v, *kn = qn + p->n_q;
    float *q = kn + p->n_k, *o = q + (size_t)heads * dh, *k = o + (size_t)heads * dh;
    float *scratch = k + (size_t)p->n_kv * dh;
    if (products(p->qkv, p->n_qkv, h, y) < 0) return -1;
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
    const size_t stride = (size_t)p->n_kv * dh, size = l->half ? 2 : 4;
    if (!p->skip_kv) { /* the row of the cache at pos (the part before shares it otherwise) */
        rope(ks, c, s, 1, kv, dh, l->neox, k);
        uint8_t *kd = (uint8_t *)kc + (size_t)pos * stride * size,
                *vd = (uint8_t *)vc + (size_t)pos * stride * size;
        if (l->half) {
            uint16_t *k16 = (uint16_t *)kd, *v16 = (uint16_t *)vd;
            for (size_t i = 0; i < stride; i++) {
                k16[i] = half_bits(k[i]);
                v16[i] = half_bits(yv[i]);
            }
        } else {
            memcpy(kd, k, stride * 4);
            memcpy(vd, yv, stride * 4);
        }
    }
    const int n_pos = pos + 1, first = l->window && n_pos > l->window ? n_pos - l->window : 0;
    attend(q, (const uint8_t *)kc + (size_t)first * stride * size,
           (const uint8_t *)vc + (size_t)first * stride * size, l->half, n_pos - first, heads,
           p->n_kv, dh, scratch, o);
    return matmul(p->out.type, p->out.w, p->out.row_bytes, p->out.rows, p->out.k, o, 1, out);
}

/* ---- one part's FFN partial (dense) ---------------------------------------------------------- */

int step_ffn(const step_layer *l, int j, const float *h, float *out, float *room) {
    const step_part *p = &l->parts[j];
    const int f = p->n_ff;
    float *gu = room, *a = gu + 2 * (size_t)f;
    if (products(p->gate_up, p->n_gate_up, h, gu) < 0) return -1;
    if (l->gelu)
        geglu(gu, l->gelu_table, 1, f, a);
    else
        swiglu(gu, 1, f, a);
    return matmul(p->down.type, p->down.w, p->down.row_bytes, p->down.rows, p->down.k, a, 1, out);
}

size_t step_room(const step_layer *l, int n_pos) {
    size_t most = 0;
    for (int j = 0; j < l->n_parts; j++) {
        const size_t a = attn_room(&l->parts[j], n_pos, l->dh), f = 3 * (size_t)l->parts[j].n_ff;
        most = a > most ? a : most;
        most = f > most ? f : most;
    }
    return most + 4 * (size_t)l->d; /* + h, a partial, the sum, a norm */
}

/* ---- the whole layer, every part in this process (no exchange) ------------------------------ */

/* x (d) += the layer: forward_rows' loop body for one row. */
int step_whole(const step_layer *l, float *x, int pos, void *const *kc, void *const *vc,
               const float *cos, const float *sin, float *room) {
    const int d = l->d;
    float *h = room, *part = h + d, *sum = part + d, *normed = sum + d, *rest = normed + d;
    for (int gate = 0; gate < 2; gate++) {
        rmsnorm(x, gate ? l->ffn_norm : l->attn_norm, 1, d, l->eps, h);
        for (int j = 0; j < l->n_parts; j++) {
            const int rc = gate ? step_ffn(l, j, h, j ? part : sum, rest)
                                : step_attn(l, j, h, pos, kc[j], vc[j], cos, sin, j ? part : sum,
                                            rest);
            if (rc < 0) return -1;
            if (j) /* _sum: the partials added in rank order */
                for (int i = 0; i < d; i++) sum[i] = sum[i] + part[i];
        }
        const float *post = gate ? l->post_ffn : l->post_attn, *add = sum;
        if (post != NULL) {
            rmsnorm(sum, post, 1, d, l->eps, normed);
            add = normed;
        }
        for (int i = 0; i < d; i++) x[i] = x[i] + add[i];
    }
    return 0;
}
