/* Drawing the next token from rows of logits: greedy, temperature, top-k and top-p, a row a
 * task on the pool (sampling.py's definition, written out here once).
 *
 * Theory of operation. A row's work is O(V) passes plus a sort of the tokens a cut keeps:
 *
 * 1. top = the largest logit; a NaN or +inf anywhere, or every logit -inf, is an error
 *    (SAMPLE_BROKEN, SAMPLE_ALL_MASKED). Greedy (temperature 0): the first index of top.
 * 2. e[i] = exp_f((z[i] - top) x inv) in float32, inv = 1 / T rounded to float (at most
 *    FLT_MAX) (exp_f, kernels.h: single-precision operations only, 0 below -87.34, so -inf
 *    logits and those a tiny temperature sends far down are 0).
 *    The row's mass S = the blocks' masses added in order, a block's mass B[b] its 64 values
 *    in eight double lanes (lane j: values j, j + 8, ...) added lane 0 to 7.
 * 3. The kept tokens, in the order the draw walks them:
 *    - no cut (top_k 0 or at least the nonzero count, top_p 1): every token in id order;
 *    - top_k: the k largest e (ties: the lower id), a heap; then, with top_p < 1 too, the
 *      first of them whose running mass reaches top_p of theirs;
 *    - top_p alone: each nonzero e in a bucket by its float exponent (one pass; bucket masses
 *      in id order), the most probable buckets taken until their mass reaches top_p x S, only
 *      their tokens sorted, then cut where the running mass reaches top_p x S (one bucket more
 *      when rounding leaves the sorted ones just short).
 *    A cut's tokens are ordered by e descending, ties by lower id.
 * 4. The draw: target = u x (the kept mass), u in [0, 1) from the caller's generator (one per
 *    sampled token, none when greedy); the token is the first kept one whose running mass
 *    exceeds target. Uncut, the blocks are walked first (B[b] as summed in 2.) and the
 *    values inside one block; where rounding leaves the walk short, the last nonzero token
 *    of that block (or of the row) is taken.
 *
 * Every operation is a fixed IEEE operation in a fixed order (built with -ffp-contract=off), so
 * a row gives the same token on every path, machine and thread count: the tensor-parallel pair
 * draws what one process draws. */

#include "kernels.h"

#include <float.h>
#include <stdlib.h>

#define BLOCK 64

typedef struct {
    float e;
    int64_t id;
} cand;

/* a before b in the draw's order: more probable first, then the lower id */
static inline int before(cand a, cand b) {
    return a.e > b.e || (a.e == b.e && a.id < b.id);
}

static int cmp_cand(const void *pa, const void *pb) {
    const cand a = *(const cand *)pa, b = *(const cand *)pb;
    return before(a, b) ? -1 : (before(b, a) ? 1 : 0);
}

/* heap of the k best so far, the worst at its root */
static void sift_down(cand *h, int64_t n, int64_t i) {
    for (;;) {
        int64_t w = i, l = 2 * i + 1, r = l + 1;
        if (l < n && before(h[w], h[l])) w = l;
        if (r < n && before(h[w], h[r])) w = r;
        if (w == i) return;
        const cand t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

/* how many leading entries of kept it takes for their running mass to reach need */
static int64_t reach(const cand *kept, int64_t n, double need) {
    double cum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        cum = cum + (double)kept[i].e;
        if (cum >= need) return i + 1;
    }
    return n;
}

/* the first of kept whose running mass exceeds u x their mass */
static int64_t draw_kept(const cand *kept, int64_t n, double u) {
    double total = 0.0;
    for (int64_t i = 0; i < n; i++) total = total + (double)kept[i].e;
    const double target = u * total;
    double cum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        cum = cum + (double)kept[i].e;
        if (cum > target) return kept[i].id;
    }
    return kept[n - 1].id;
}

static int64_t last_nonzero(const float *e, int64_t from, int64_t to) {
    for (int64_t i = to - 1; i >= from; i--)
        if (e[i] > 0.0f) return i;
    return -1;
}

/* The first token of e[0, v) at which the running mass, starting from acc, exceeds target: the
 * blocks walked first (bsum), then the values of the block where it does; where rounding leaves
 * that block's walk short, its last nonzero token. -1 when no block takes it past target. */
static int64_t walk_blocks(const float *e, const double *bsum, int64_t v, double acc,
                           double target) {
    const int64_t nb = (v + BLOCK - 1) / BLOCK;
    for (int64_t b = 0; b < nb; b++) {
        if (acc + bsum[b] > target) {
            const int64_t end = (b + 1) * BLOCK < v ? (b + 1) * BLOCK : v;
            double c = acc;
            for (int64_t i = b * BLOCK; i < end; i++) {
                c = c + (double)e[i];
                if (c > target) return i;
            }
            const int64_t last = last_nonzero(e, b * BLOCK, end);
            if (last >= 0) return last;
        }
        acc = acc + bsum[b];
    }
    return -1;
}

/* the uncut draw over blocks (see 4.), total the row's mass (the blocks' added in order) */
static int64_t draw_row(const float *e, const double *bsum, int64_t v, double total, double u) {
    const int64_t t = walk_blocks(e, bsum, v, 0.0, u * total);
    return t >= 0 ? t : last_nonzero(e, 0, v);
}

/* top_p alone (see 3.): the kept tokens into kept, their count returned */
static int64_t nucleus(const float *e, int64_t v, double need, cand *kept) {
    double mass[256] = {0};
    for (int64_t i = 0; i < v; i++) {
        uint32_t bits;
        memcpy(&bits, &e[i], sizeof bits);
        if (e[i] > 0.0f) mass[255 - (bits >> 23)] += (double)e[i]; /* 128: e = 1 */
    }
    double cum = 0.0;
    int last = 128;
    while (last < 255 && cum + mass[last] < need) cum = cum + mass[last++];
    for (; last < 256; last++) {
        const uint32_t floor_bits = (uint32_t)(255 - last) << 23; /* bucket `last` and above */
        int64_t n = 0;
        for (int64_t i = 0; i < v; i++) {
            uint32_t bits;
            memcpy(&bits, &e[i], sizeof bits);
            if (e[i] > 0.0f && bits >= floor_bits) kept[n++] = (cand){e[i], i};
        }
        qsort(kept, (size_t)n, sizeof *kept, cmp_cand);
        const int64_t m = reach(kept, n, need);
        if (m < n || last == 255) return m;
        double all = 0.0;
        for (int64_t i = 0; i < n; i++) all = all + (double)kept[i].e;
        if (all >= need) return m;
    }
    return 0;
}

/* top_k (see 3.): the limit most probable nonzero tokens into kept, by a heap (the worst at
 * its root), then in the draw's order */
static void keep_top_k(const float *e, int64_t v, int64_t limit, cand *kept) {
    int64_t n = 0;
    for (int64_t i = 0; i < v; i++) {
        if (!(e[i] > 0.0f)) continue;
        const cand c = {e[i], i};
        if (n < limit) {
            kept[n++] = c;
            if (n == limit)
                for (int64_t j = n / 2 - 1; j >= 0; j--) sift_down(kept, n, j);
        } else if (before(c, kept[0])) {
            kept[0] = c;
            sift_down(kept, n, 0);
        }
    }
    qsort(kept, (size_t)n, sizeof *kept, cmp_cand);
}

/* 1.'s pass: the largest logit, and whether any is NaN or +inf (a maximum is exact in any order;
 * -0 and +0, which it may pick either of, give the same x in 2.). */
static float row_max_portable(const float *z, int64_t v, int *broken) {
    float top = -INFINITY;
    for (int64_t i = 0; i < v; i++) {
        *broken |= (z[i] != z[i]) | (z[i] == INFINITY);
        top = z[i] > top ? z[i] : top;
    }
    return top;
}

#if defined(FOUNDRY_X86)
AVX512 static float row_max_512(const float *z, int64_t v, int *broken) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    const __m512 inf = _mm512_set1_ps(INFINITY);
    __mmask16 bad = 0;
    int64_t i = 0;
    for (; i + 16 <= v; i += 16) {
        const __m512 x = _mm512_loadu_ps(z + i);
        bad |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(x, inf, _CMP_EQ_OQ);
        m = _mm512_max_ps(x, m);
    }
    float top = _mm512_reduce_max_ps(m);
    *broken |= bad != 0;
    const float rest = row_max_portable(z + i, v - i, broken);
    return rest > top ? rest : top;
}

AVX2 static float row_max_avx2(const float *z, int64_t v, int *broken) {
    __m256 m = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
    const __m256 inf = _mm256_set1_ps(INFINITY);
    int64_t i = 0;
    for (; i + 8 <= v; i += 8) {
        const __m256 x = _mm256_loadu_ps(z + i);
        bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q),
                                             _mm256_cmp_ps(x, inf, _CMP_EQ_OQ)));
        m = _mm256_max_ps(x, m);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    float top = lanes[0];
    for (int j = 1; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
    *broken |= _mm256_movemask_ps(bad) != 0;
    const float rest = row_max_portable(z + i, v - i, broken);
    return rest > top ? rest : top;
}
#endif

/* 2.'s pass, one body compiled for the portable path and for AVX2 and AVX-512 (vectorised by the
 * compiler, lane by lane: the same bits): the probabilities, their count above 0 and the blocks'
 * masses. inv is at most FLT_MAX, so x is never NaN (0 x inv = 0, -inf x inv = -inf). */
#define SAMPLE_LOOPS(SUFFIX, ATTR)                                                                 \
    ATTR static int64_t row_probs##SUFFIX(const float *restrict z, int64_t v, float top,           \
                                          float inv, float *restrict e, double *restrict bsum) {   \
        for (int64_t i = 0; i < v; i++) e[i] = exp_f((z[i] - top) * inv);                          \
        int64_t nonzero = 0;                                                                       \
        for (int64_t i = 0; i < v; i++) nonzero += e[i] > 0.0f;                                    \
        for (int64_t lo = 0; lo < v; lo += BLOCK) {                                                \
            double lane[8] = {0};                                                                  \
            if (v - lo >= BLOCK) {                                                                 \
                for (int k = 0; k < BLOCK; k += 8)                                                 \
                    for (int j = 0; j < 8; j++) lane[j] = lane[j] + (double)e[lo + k + j];         \
            } else {                                                                               \
                for (int64_t i = lo; i < v; i++) lane[(i - lo) % 8] += (double)e[i];               \
            }                                                                                      \
            double s = 0.0;                                                                        \
            for (int j = 0; j < 8; j++) s = s + lane[j];                                           \
            bsum[lo / BLOCK] = s;                                                                  \
        }                                                                                          \
        return nonzero;                                                                            \
    }

SAMPLE_LOOPS(_portable, )
#if defined(FOUNDRY_X86)
SAMPLE_LOOPS(_avx2, AVX2)
SAMPLE_LOOPS(_512, AVX512)
#endif

/* A buffer of this thread's, kept for the next row (a row's probabilities are 1 MB at 262,144
 * tokens: malloc would map and fault them in every call). NULL when out of memory. */
static void *scratch(size_t bytes) {
    static _Thread_local void *buf;
    static _Thread_local size_t cap;
    if (bytes > cap) {
        free(buf);
        buf = malloc(bytes);
        cap = buf != NULL ? bytes : 0;
    }
    return buf;
}

typedef int64_t (*probs_pass)(const float *, int64_t, float, float, float *, double *);

/* 2.'s pass as this machine runs it */
static probs_pass row_probs_here(void) {
#if defined(FOUNDRY_X86)
    if (use_512) return row_probs_512;
    if (use_avx2) return row_probs_avx2;
#endif
    return row_probs_portable;
}

/* 1 / T rounded to float, at most FLT_MAX (2.) */
static float inv_of(double temperature) {
    const double inv = 1.0 / temperature;
    return inv < FLT_MAX ? (float)inv : FLT_MAX;
}

/* The first i with z[i] == top (a greedy row's token: its largest logit's first place), 8 at a
 * time where AVX2 is in use: the same comparison, so the same index. */
static int64_t first_equal_portable(const float *z, int64_t v, float top) {
    for (int64_t i = 0; i < v; i++)
        if (z[i] == top) return i;
    return -1;
}

#if defined(FOUNDRY_X86)
AVX2 static int64_t first_equal_avx2(const float *z, int64_t v, float top) {
    const __m256 t = _mm256_set1_ps(top);
    int64_t i = 0;
    for (; i + 8 <= v; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(z + i), t, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
    const int64_t rest = first_equal_portable(z + i, v - i, top);
    return rest < 0 ? -1 : i + rest;
}
#endif

int64_t sample_row(const float *z, int64_t v, const sample_args *a) {
    float (*row_max)(const float *, int64_t, int *) = row_max_portable;
#if defined(FOUNDRY_X86)
    if (use_512)
        row_max = row_max_512;
    else if (use_avx2)
        row_max = row_max_avx2;
#endif
    int broken = 0;
    const float top = row_max(z, v, &broken);
    if (broken) return SAMPLE_BROKEN;
    if (top == -INFINITY) return SAMPLE_ALL_MASKED;
    if (a->temperature == 0.0) {
#if defined(FOUNDRY_X86)
        if (use_avx2) return first_equal_avx2(z, v, top);
#endif
        return first_equal_portable(z, v, top);
    }
    const int64_t nb = (v + BLOCK - 1) / BLOCK;
    const size_t e_bytes = ((size_t)v * sizeof(float) + 63) / 64 * 64;
    char *room = scratch(e_bytes + (size_t)nb * sizeof(double));
    if (room == NULL) return SAMPLE_NO_MEMORY;
    float *e = (float *)room;
    double *bsum = (double *)(room + e_bytes);
    const int64_t nonzero = row_probs_here()(z, v, top, inv_of(a->temperature), e, bsum);
    const int64_t limit = a->top_k == 0 || a->top_k > nonzero ? nonzero : a->top_k;
    double mass = 0.0; /* the row's, the blocks' added in order */
    for (int64_t b = 0; b < nb; b++) mass = mass + bsum[b];
    if (limit == nonzero && a->top_p >= 1.0) return draw_row(e, bsum, v, mass, a->u);
    cand *kept = malloc((size_t)limit * sizeof *kept);
    if (kept == NULL) return SAMPLE_NO_MEMORY;
    int64_t n;
    if (limit < nonzero) {
        keep_top_k(e, v, limit, kept);
        n = limit;
        if (a->top_p < 1.0) {
            double kept_mass = 0.0;
            for (int64_t i = 0; i < n; i++) kept_mass = kept_mass + (double)kept[i].e;
            n = reach(kept, n, a->top_p * kept_mass);
        }
    } else {
        n = nucleus(e, v, a->top_p * mass, kept);
    }
    const int64_t token = draw_kept(kept, n, a->u);
    free(kept);
    return token;
}

typedef struct {
    const float *const *z;
    int64_t v;
    const sample_args *args;
    int64_t *out;
} rows_job;

static int rows_task(void *ctx, int i) {
    const rows_job *j = ctx;
    j->out[i] = sample_row(j->z[i], j->v, &j->args[i]);
    return 0;
}

void sample_rows(const float *const *z, int rows, int64_t v, const sample_args *args,
                 int64_t *out) {
    rows_job job = {z, v, args, out};
    pool_run(rows_task, &job, rows);
}

/* A row in blocks. A tensor-parallel pair holds a row of logits as blocks of the vocabulary,
 * the leader's first; each block starts on a multiple of BLOCK, so each rank's block masses
 * are those of the whole row. The ranks draw what sample_row draws from the whole row:
 *
 * - every block's largest logit and its first index (sample_rows at temperature 0) give the
 *   row's top, or its error, to every rank;
 * - PART_PASS (the leader): e and the block masses of its block with that top (2.), their
 *   count above 0, its last nonzero token, and mass = the masses added in order: the mass of
 *   the row before the worker's block;
 * - PART_TAIL (the worker): the same with acc = the leader's mass, so mass is the row's (the
 *   same additions in the same order), and nonzero + ARG_NONZERO (the leader's count) the
 *   row's. Then 3. and 4.: a row cut to top_k gives its block's min(top_k, nonzero) best
 *   (KIND_TOP_K; the leader merges them with its own, which are the row's best among its
 *   block's, and draws over the top_k best of both); an uncut row's target = u x mass lies in
 *   the leader's block when the leader's mass exceeds it (KIND_LEADER_WALK, the blocks'
 *   running mass only grows), else the walk goes on through the worker's blocks from the
 *   leader's mass (KIND_TOKEN), and where rounding leaves the whole row short, the row's last
 *   nonzero token: the worker's, else the leader's (KIND_LEADER_LAST);
 * - PART_FINISH (the worker, after a PART_PASS of its block with the row's top while the
 *   leader ran its own): PART_TAIL on that pass's e, block masses, count and last token (its
 *   outputs, read back), so the same additions in the same order without a second pass;
 * - PART_WALK, PART_LAST, PART_TOP_K (the leader, on the e of its PART_PASS): the walk of its
 *   blocks to a target, its last nonzero token, its min(top_k, nonzero) best. */
typedef struct {
    const float *z;
    int64_t v, k;
    float *e;
    double *bsum;
    const double *args;
    double *out;
    float *cand_e;
    int64_t *cand_id;
} parts_job;

/* the block's best min(k, nonzero) into cand_e / cand_id, in the draw's order; their count,
 * or SAMPLE_NO_MEMORY */
static int64_t block_top_k(const float *e, int64_t v, int64_t k, int64_t nonzero, float *cand_e,
                           int64_t *cand_id) {
    const int64_t m = k < nonzero ? k : nonzero;
    if (m == 0) return 0;
    cand *kept = malloc((size_t)m * sizeof *kept);
    if (kept == NULL) return SAMPLE_NO_MEMORY;
    keep_top_k(e, v, m, kept);
    for (int64_t i = 0; i < m; i++) {
        cand_e[i] = kept[i].e;
        cand_id[i] = kept[i].id;
    }
    free(kept);
    return m;
}

static int parts_task(void *ctx, int i) {
    const parts_job *j = ctx;
    const int64_t v = j->v, nb = (v + BLOCK - 1) / BLOCK;
    const double *a = j->args + (int64_t)i * PART_ARGS;
    double *o = j->out + (int64_t)i * PART_OUTS;
    float *e = j->e + (int64_t)i * v;
    double *bsum = j->bsum + (int64_t)i * nb;
    float *ce = j->cand_e + (int64_t)i * j->k;
    int64_t *cid = j->cand_id + (int64_t)i * j->k;
    const int mode = (int)a[ARG_MODE];
    const int64_t top_k = (int64_t)a[ARG_TOP_K];
    o[OUT_KIND] = KIND_NONE;
    o[OUT_N] = 0;
    if (mode == PART_PASS || mode == PART_TAIL || mode == PART_FINISH) {
        if (mode != PART_FINISH) {
            o[OUT_NONZERO] = (double)row_probs_here()(j->z + (int64_t)i * v, v, (float)a[ARG_TOP],
                                                      (float)a[ARG_INV], e, bsum);
            o[OUT_LAST] = (double)last_nonzero(e, 0, v);
        }
        const int64_t nonzero = (int64_t)o[OUT_NONZERO], last = (int64_t)o[OUT_LAST];
        double mass = a[ARG_ACC];
        for (int64_t b = 0; b < nb; b++) mass = mass + bsum[b];
        o[OUT_MASS] = mass;
        if (mode == PART_PASS) return 0;
        const int64_t all = nonzero + (int64_t)a[ARG_NONZERO];
        if (top_k != 0 && top_k < all) {
            const int64_t n = block_top_k(e, v, top_k, nonzero, ce, cid);
            o[OUT_KIND] = n < 0 ? (double)n : KIND_TOP_K;
            o[OUT_N] = n < 0 ? 0 : (double)n;
            return 0;
        }
        const double target = a[ARG_U] * mass;
        o[OUT_TARGET] = target;
        if (a[ARG_ACC] > target) {
            o[OUT_KIND] = KIND_LEADER_WALK;
            return 0;
        }
        const int64_t t = walk_blocks(e, bsum, v, a[ARG_ACC], target);
        o[OUT_KIND] = t >= 0 || last >= 0 ? KIND_TOKEN : KIND_LEADER_LAST;
        o[OUT_INDEX] = (double)(t >= 0 ? t : last);
    } else if (mode == PART_WALK) {
        const int64_t t = walk_blocks(e, bsum, v, 0.0, a[ARG_TARGET]);
        o[OUT_KIND] = KIND_TOKEN;
        o[OUT_INDEX] = (double)(t >= 0 ? t : last_nonzero(e, 0, v));
    } else if (mode == PART_LAST) {
        o[OUT_KIND] = KIND_TOKEN;
        o[OUT_INDEX] = (double)last_nonzero(e, 0, v);
    } else if (mode == PART_TOP_K) {
        const int64_t n = block_top_k(e, v, top_k, (int64_t)a[ARG_NONZERO], ce, cid);
        o[OUT_KIND] = n < 0 ? (double)n : KIND_TOP_K;
        o[OUT_N] = n < 0 ? 0 : (double)n;
    }
    return 0;
}

void sample_parts(const float *z, int rows, int64_t v, float *e, double *bsum, const double *args,
                  double *out, int64_t k, float *cand_e, int64_t *cand_id) {
    parts_job job = {z, v, k, e, bsum, args, out, cand_e, cand_id};
    pool_run(parts_task, &job, rows);
}
