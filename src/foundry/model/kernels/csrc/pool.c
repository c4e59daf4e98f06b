/* The thread pool every product runs on, and the products split over it.
 *
 * Theory of operation. One pool per process, of pool_threads() threads: the caller of
 * pool_run and pool_threads() - 1 workers started once (pool_set_threads, from the engine's
 * thread count). A call publishes its task list in a new ticket (generation, task count, next
 * task number: one 64-bit atomic); every thread then takes task numbers from the ticket until
 * none is left, and the caller returns when every task is done. A worker that comes late (its
 * core taken by another thread or the hypervisor, or woken after the others took every task)
 * finds none left and is not waited for: a call costs the tasks' time, not the slowest
 * thread's wake-up, which on a host with as many busy threads as cores cost a small file's
 * decode 5x at 16 threads. Between calls a worker spins on the
 * generation for SPIN_NS (a decode step's products come microseconds apart, and a futex wake
 * costs tens of them), yielding its core every 256 polls to any thread that waits for one,
 * then sleeps on a condition variable until the next call.
 *
 * Results never depend on the thread count: a task writes outputs that no other task writes,
 * and computes each of them with the one-thread code over the same inputs (a product's row is
 * its own dot product whatever rows a call holds: kernels.h), so which thread runs a task, and
 * how many threads share the tasks, changes no bit. Only the split into tasks is fixed by the
 * shape; the order in which threads take them is not, and need not be.
 *
 * Memory ordering: the caller writes the task list, then stores the new ticket with release
 * order; a thread whose fetch-and-add on the ticket reads that generation (acquire) sees the
 * list, which stays until the call returns, and the call does not return before every task of
 * it is done. A fetch-and-add that lands on a later call's ticket takes that call's task, with
 * that call's list. Each task's writes to its outputs happen before its release increment of
 * `done`, which the caller reads with acquire order before returning, so the outputs are
 * visible to the caller. The task number field never overflows: each thread overshoots the
 * task count at most once a call (MAX_TASKS leaves room for every thread).
 *
 * One call at a time: a second caller (another Python thread, or a task that calls a product)
 * finds the pool busy and runs its tasks alone, in the same split: the same bits.
 */

#include "kernels.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sched.h>
#include <time.h>

#define MAX_THREADS 512
/* How long an idle worker polls before it sleeps: longer than the gap between two products of
 * a decode step (a few microseconds of Python or C), far shorter than the gap between requests. */
#define SPIN_NS 200000L

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) || (defined(__arm__) && __ARM_ARCH >= 7)
    __asm__ __volatile__("yield");
#endif
}

/* Each counter on a cache line of its own: the workers poll the ticket's generation while the
 * tasks take numbers from it and report to `done`; sharing a line, every task's write would
 * take the line from every polling core. */
#define LINE 64
/* The ticket's fields: generation (bits 40-63), the call's task count (20-39), the next task
 * number (0-19). */
#define GEN_SHIFT   40
#define COUNT_SHIFT 20
#define FIELD_MASK  ((1u << COUNT_SHIFT) - 1)
#define MAX_TASKS   ((int)FIELD_MASK - MAX_THREADS) /* more run on the caller alone */

static struct {
    _Alignas(LINE) _Atomic uint64_t ticket;
    _Alignas(LINE) atomic_int done; /* tasks of the current call finished */
    _Alignas(LINE) atomic_int failed;
    atomic_int busy; /* a call in progress */
    atomic_int stop;
    pool_task task;
    void *ctx;
    int n_threads;        /* workers + the caller */
    pthread_mutex_t lock; /* guards sleeping workers' wait and the wake-up */
    pthread_cond_t wake;
    pthread_t threads[MAX_THREADS];
} pool = {.n_threads = 1, .lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

int prof_on;
uint64_t prof_ns[PROF_N], prof_calls[PROF_N];

uint64_t prof_clock(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long)t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline uint64_t generation(void) {
    return atomic_load_explicit(&pool.ticket, memory_order_acquire) >> GEN_SHIFT;
}

/* Tasks taken from the ticket until none is left; *gen: the generation last drawn from. */
static void take_tasks(uint64_t *gen) {
    for (;;) {
        const uint64_t t = atomic_fetch_add_explicit(&pool.ticket, 1, memory_order_acq_rel);
        *gen = t >> GEN_SHIFT;
        if ((int)(t & FIELD_MASK) >= (int)((t >> COUNT_SHIFT) & FIELD_MASK)) return;
        if (pool.task(pool.ctx, (int)(t & FIELD_MASK)) < 0)
            atomic_store_explicit(&pool.failed, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
    }
}

static void *worker(void *arg) {
    /* the generation when it was started (not read here: a call may already have begun) */
    uint64_t seen = (uint64_t)(uintptr_t)arg;
    for (;;) {
        uint64_t g = generation();
        if (g == seen && !atomic_load_explicit(&pool.stop, memory_order_acquire)) {
            const long until = now_ns() + SPIN_NS;
            for (int spins = 0; g == seen; spins++) {
                cpu_relax();
                g = generation();
                if (atomic_load_explicit(&pool.stop, memory_order_acquire)) break;
                if ((spins & 255) != 255) continue;
                /* a thread of this process that lost its core to a spinning worker (the engine
                 * thread between two calls, or one holding the GIL) gets it back now, not at
                 * the end of a scheduler slice: on a process pinned to as many cores as it has
                 * threads, that wait cost a rank of a world 4x its tokens/s */
                sched_yield();
                if (now_ns() > until) {
                    pthread_mutex_lock(&pool.lock);
                    while ((g = generation()) == seen &&
                           !atomic_load_explicit(&pool.stop, memory_order_acquire))
                        pthread_cond_wait(&pool.wake, &pool.lock);
                    pthread_mutex_unlock(&pool.lock);
                    break;
                }
            }
        }
        if (atomic_load_explicit(&pool.stop, memory_order_acquire)) return NULL;
        take_tasks(&seen);
    }
}

int pool_threads(void) {
    return pool.n_threads;
}

static void stop_workers(void) {
    pthread_mutex_lock(&pool.lock);
    atomic_store_explicit(&pool.stop, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    for (int i = 0; i < pool.n_threads - 1; i++) pthread_join(pool.threads[i], NULL);
    atomic_store_explicit(&pool.stop, 0, memory_order_release);
    pool.n_threads = 1;
}

int pool_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    int expected = 0;
    while (!atomic_compare_exchange_weak(&pool.busy, &expected, 1)) { /* a call in progress */
        expected = 0;
        cpu_relax();
    }
    int rc = 0;
    if (n != pool.n_threads) {
        stop_workers();
        const uint64_t g = generation();
        for (int i = 0; i < n - 1; i++) {
            if (pthread_create(&pool.threads[i], NULL, worker, (void *)(uintptr_t)g) != 0) {
                rc = -1;
                break;
            }
            pool.n_threads = i + 2;
        }
    }
    atomic_store_explicit(&pool.busy, 0, memory_order_release);
    return rc;
}

/* Until *count reaches target (acquire: what was written before each increment is seen),
 * polling; on a machine with more runnable threads than cores the core goes to them now and
 * then. */
static void wait_count(atomic_int *count, int target) {
    for (int spins = 1; atomic_load_explicit(count, memory_order_acquire) < target; spins++) {
        cpu_relax();
        if ((spins & 1023) == 0) sched_yield();
    }
}

int pool_run(pool_task task, void *ctx, int n_tasks) {
    int expected = 0;
    if (pool.n_threads == 1 || n_tasks < 2 || n_tasks > MAX_TASKS ||
        !atomic_compare_exchange_strong(&pool.busy, &expected, 1)) {
        for (int i = 0; i < n_tasks; i++) /* alone: the same tasks, in order */
            if (task(ctx, i) < 0) return -1;
        return 0;
    }
    PROF_START(t0);
    pool.task = task;
    pool.ctx = ctx;
    atomic_store_explicit(&pool.failed, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    const uint64_t gen = (generation() + 1) & ((1u << (64 - GEN_SHIFT)) - 1);
    pthread_mutex_lock(&pool.lock); /* a sleeping worker waits under the lock: none is missed */
    atomic_store_explicit(&pool.ticket, gen << GEN_SHIFT | (uint64_t)n_tasks << COUNT_SHIFT,
                          memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    uint64_t drawn;
    take_tasks(&drawn);
    PROF_START(t1);
    wait_count(&pool.done, n_tasks); /* the tasks other threads still run */
    const int failed = atomic_load_explicit(&pool.failed, memory_order_relaxed);
    atomic_store_explicit(&pool.busy, 0, memory_order_release);
    PROF_STOP(t1, PROF_JOIN);
    PROF_STOP(t0, PROF_POOL);
    return failed ? -1 : 0;
}

/* ---- products on the pool ------------------------------------------------------------------ */

/* Work below which a product runs on the caller alone (weights bytes x inputs): waking the
 * workers costs more than a small matrix. Above it, a task holds at least a quarter of it, so
 * a product of a few hundred KB takes a few threads instead of the caller alone (at 16 threads
 * the bench preset's output products ran alone under the earlier rule, "less than this per
 * thread": 624 us a token against 114 split). pool_split_below changes it (tests split the
 * tiny models' products to compare their bits). */
static long small_work = 64L * 1024;

void pool_split_below(long bytes) {
    small_work = bytes < 0 ? 0 : bytes;
}

long pool_split_work(void) {
    return small_work;
}
/* Rows per task: a multiple of every path's row group (4 or 8 rows), enough for a task to
 * stream its weights at full speed; about two tasks a thread, so a slower core takes fewer. */
#define ROW_ALIGN 16

/* Rows per task of a product of n_out rows of row_bytes x n: about two tasks a thread, each
 * at least a quarter of small_work, whole groups of ROW_ALIGN. */
static int task_rows(int n_out, size_t row_bytes, int n, int threads) {
    int rows = (n_out + 2 * threads - 1) / (2 * threads);
    const double least = (double)small_work / 4 / ((double)row_bytes * n);
    if (least > rows) rows = least > n_out ? n_out : (int)least + 1;
    rows = (rows + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
    return rows < ROW_ALIGN ? ROW_ALIGN : rows;
}

/* ---- prepared inputs ------------------------------------------------------------------------ */

int mm_alloc(int type, int k, int n, mm_input *in) {
    memset(in, 0, sizeof *in);
    in->type = type;
    in->k = k;
    in->n = n;
    const size_t values = (size_t)n * k;
    int ok = 1;
    switch (type) {
    case T_Q8_0:
    case T_Q4_0:
    case T_Q5_0:
        in->type = q32_input_type(type, n);
        ok = (in->xq = malloc(values)) && (in->xd = malloc(values / QK * sizeof(float))) &&
             (in->corr = malloc(values / 4 * sizeof(int32_t)));
#if defined(FOUNDRY_X86)
        if (ok && type == T_Q4_0 && use_avx2)
            ok = (in->x4 = malloc(values)) && (in->corr4 = malloc(values / 8 * sizeof(int32_t)));
#endif
        break;
    case T_Q4_1:
    case T_Q5_1:
        ok = (in->xq = malloc(values)) && (in->xd = malloc(values / QK * sizeof(float))) &&
             (in->sums = malloc(values / QK * sizeof(float)));
        break;
    case T_Q4_K:
    case T_Q5_K:
    case T_Q6_K:
        ok = (in->xq = malloc(values)) && (in->xd = malloc(values / QK_K * sizeof(float))) &&
             (in->s32 = malloc(values / QK * sizeof(int32_t))) &&
             (in->s32h = malloc(values / QK * sizeof(int16_t))) &&
             (type != T_Q6_K || (in->x32p = malloc(values / 2 * sizeof(int16_t))));
        break;
    default: break;
    }
    if (!ok) {
        mm_free(in);
        return -1;
    }
    return 0;
}

void mm_fill(const mm_input *in, const float *x, int t0, int t1) {
    switch (in->type) {
    case T_Q8_0:
    case T_Q4_0:
    case T_Q5_0: fill_q32(in, x, t0, t1); break;
    case T_Q4_1:
    case T_Q5_1: fill_q1(in, x, t0, t1); break;
    case T_Q4_K:
    case T_Q5_K:
    case T_Q6_K: fill_k(in, x, t0, t1); break;
    default: break;
    }
}

#define FROM(field, per) (in->field != NULL ? in->field + (size_t)t0 * (per) : NULL)

mm_input mm_from(const mm_input *in, int t0) {
    const int k = in->k, kquant = in->type == T_Q4_K || in->type == T_Q5_K || in->type == T_Q6_K;
    mm_input out = *in;
    out.n = in->n - t0;
    out.xq = FROM(xq, k);
    out.xd = FROM(xd, k / (kquant ? QK_K : QK));
    out.corr = FROM(corr, k / 4);
    out.x4 = FROM(x4, k);
    out.corr4 = FROM(corr4, k / 8);
    out.sums = FROM(sums, k / QK);
    out.s32 = FROM(s32, k / QK);
    out.s32h = FROM(s32h, k / QK);
    out.x32p = FROM(x32p, k / 2);
    return out;
}

void mm_free(mm_input *in) {
    free(in->xq);
    free(in->xd);
    free(in->corr);
    free(in->x4);
    free(in->corr4);
    free(in->sums);
    free(in->s32);
    free(in->s32h);
    free(in->x32p);
    memset(in, 0, sizeof *in);
}

/* ---- a product on the pool: its inputs prepared (split by inputs), then its rows ------------ */

typedef struct {
    int type, n_out, k, n, rows, tokens, row_tasks;
    size_t row_bytes;
    const uint8_t *w;
    const float *x;
    const mm_input *in;
    float *y;
    int fills;         /* the call's first tasks prepare the inputs, FILL_TOKENS each */
    atomic_int filled; /* of them done */
} matmul_job;

#define FILL_TOKENS 8 /* inputs per task of the preparation */

/* Task i < fills prepares its inputs; a product task waits until every input is prepared.
 * The fills are the call's first task numbers, which threads take before any product's (the
 * ticket hands numbers out in order, and a caller alone runs them in order), so a thread that
 * waits waits only for fills that other threads are running: one pool call instead of two. */
static int matmul_task(void *ctx, int i) {
    matmul_job *j = ctx;
    if (i < j->fills) {
        const int t0 = i * FILL_TOKENS, t1 = t0 + FILL_TOKENS < j->n ? t0 + FILL_TOKENS : j->n;
        mm_fill(j->in, j->x, t0, t1);
        atomic_fetch_add_explicit(&j->filled, 1, memory_order_release);
        return 0;
    }
    i -= j->fills;
    wait_count(&j->filled, j->fills);
    const int r0 = (i % j->row_tasks) * j->rows, t0 = (i / j->row_tasks) * j->tokens;
    const int rows = j->n_out - r0 < j->rows ? j->n_out - r0 : j->rows;
    const int tokens = j->n - t0 < j->tokens ? j->n - t0 : j->tokens;
    const mm_input in = mm_from(j->in, t0);
    return matmul_part(j->type, j->w + (size_t)r0 * j->row_bytes, j->row_bytes, rows, j->k,
                       j->x + (size_t)t0 * j->k, &in, tokens, j->y + (size_t)t0 * j->n_out + r0,
                       (size_t)j->n_out);
}

int matmul(int type, const uint8_t *w, size_t row_bytes, int n_out, int k, const float *x, int n,
           float *y) {
    mm_input in;
    if (mm_alloc(type, k, n, &in) < 0) return -1;
    const int threads = pool_threads();
    matmul_job job = {type, n_out, k, n, n_out, n, 1, row_bytes, w, x, &in, y, 0, 0};
    if (threads == 1 || n_out < 2 * ROW_ALIGN ||
        (double)row_bytes * n_out * n < (double)small_work) {
        PROF_START(t0);
        mm_fill(&in, x, 0, n);
        const int rc = matmul_part(type, w, row_bytes, n_out, k, x, &in, n, y, (size_t)n_out);
        mm_free(&in);
        if (threads > 1) PROF_STOP(t0, PROF_ALONE);
        return rc;
    }
    if (n >= 2 * FILL_TOKENS) /* the inputs' preparation split too, in the same call */
        job.fills = (n + FILL_TOKENS - 1) / FILL_TOKENS;
    else
        mm_fill(&in, x, 0, n);
    const int rows = task_rows(n_out, row_bytes, n, threads);
    const int row_tasks = (n_out + rows - 1) / rows;
    /* a block of inputs whose rows give fewer tasks than threads: the inputs split too, in
     * tiles of 64 (the kernels' L2 tiles) */
    int tokens = n;
    if (n > 64 && row_tasks < 2 * threads) {
        const int parts = (2 * threads + row_tasks - 1) / row_tasks;
        tokens = (n + parts - 1) / parts;
        tokens = (tokens + 63) / 64 * 64;
    }
    const int token_tasks = (n + tokens - 1) / tokens;
    job.rows = rows;
    job.tokens = tokens;
    job.row_tasks = row_tasks;
    const int rc = pool_run(matmul_task, &job, job.fills + row_tasks * token_tasks);
    mm_free(&in);
    return rc;
}

/* ---- several one-input products in one pool call -------------------------------------------- */

typedef struct {
    const mm_item *items;
    mm_input *in;     /* each item's prepared input */
    const int *first; /* the first task of each item; first[count] = the tasks */
    const int *rows;  /* rows per task of each item */
    int count;
} many_job;

static int many_task(void *ctx, int i) {
    const many_job *j = ctx;
    int it = 0;
    while (j->first[it + 1] <= i) it++;
    const mm_item *m = &j->items[it];
    const int r0 = (i - j->first[it]) * j->rows[it];
    const int rows = m->n_out - r0 < j->rows[it] ? m->n_out - r0 : j->rows[it];
    return matmul_part(m->type, m->w + (size_t)r0 * m->row_bytes, m->row_bytes, rows, m->k, m->x,
                       &j->in[it], 1, m->y + r0, (size_t)m->n_out);
}

int matmul_many(const mm_item *items, int count) {
    const int threads = pool_threads();
    double work = 0;
    for (int i = 0; i < count; i++) work += (double)items[i].row_bytes * items[i].n_out;
    if (threads == 1 || count < 2 || work < (double)small_work) {
        for (int i = 0; i < count; i++) {
            const mm_item *m = &items[i];
            if (matmul(m->type, m->w, m->row_bytes, m->n_out, m->k, m->x, 1, m->y) < 0) return -1;
        }
        return 0;
    }
    mm_input *in = calloc((size_t)count, sizeof *in);
    int *first = malloc(((size_t)count + 1) * sizeof(int));
    int *rows = malloc((size_t)count * sizeof(int));
    int rc = -1, prepared = 0;
    if (in == NULL || first == NULL || rows == NULL) goto done;
    /* each item's rows in tasks of about the same share of the whole: two tasks a thread,
     * each at least a quarter of small_work */
    double share = work / (2.0 * threads);
    share = share < (double)small_work / 4 ? (double)small_work / 4 : share;
    first[0] = 0;
    for (int i = 0; i < count; i++, prepared++) {
        const mm_item *m = &items[i];
        if (mm_alloc(m->type, m->k, 1, &in[i]) < 0) goto done;
        mm_fill(&in[i], m->x, 0, 1);
        int r = (int)(share / (double)m->row_bytes);
        r = (r + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN;
        r = r < ROW_ALIGN ? ROW_ALIGN : r;
        rows[i] = r > m->n_out ? m->n_out : r;
        first[i + 1] = first[i] + (m->n_out + rows[i] - 1) / rows[i];
    }
    many_job job = {items, in, first, rows, count};
    rc = pool_run(many_task, &job, first[count]);
done:
    for (int i = 0; i < prepared; i++) mm_free(&in[i]);
    free(in);
    free(first);
    free(rows);
    return rc;
}

/* ---- a block of inputs in groups, each times its own matrix, in one pool call ------------- */

typedef struct {
    const mm_group *g;
    mm_input *in; /* each group's prepared inputs */
    const float *x;
    float *y;
    int n_out, k, count;
    const int *fill_first, *first; /* each group's first fill and product task; [count]: all */
    const int *rows;               /* rows per product task of each group */
} groups_job;

static int group_of(const int *first, int i) {
    int g = 0;
    while (first[g + 1] <= i) g++;
    return g;
}

static int groups_fill_task(void *ctx, int i) {
    const groups_job *j = ctx;
    const int g = group_of(j->fill_first, i), n = j->g[g].t1 - j->g[g].t0;
    const int t0 = (i - j->fill_first[g]) * FILL_TOKENS;
    mm_fill(&j->in[g], j->x + (size_t)j->g[g].t0 * j->k, t0,
            t0 + FILL_TOKENS < n ? t0 + FILL_TOKENS : n);
    return 0;
}

static int groups_task(void *ctx, int i) {
    const groups_job *j = ctx;
    const int g = group_of(j->first, i);
    const mm_group *m = &j->g[g];
    const int r0 = (i - j->first[g]) * j->rows[g];
    const int rows = j->n_out - r0 < j->rows[g] ? j->n_out - r0 : j->rows[g];
    return matmul_part(m->type, m->w + (size_t)r0 * m->row_bytes, m->row_bytes, rows, j->k,
                       j->x + (size_t)m->t0 * j->k, &j->in[g], m->t1 - m->t0,
                       j->y + (size_t)m->t0 * j->n_out + r0, (size_t)j->n_out);
}

int matmul_groups(const mm_group *groups, int count, int n_out, int k, const float *x, float *y) {
    const int threads = pool_threads();
    if (threads == 1 || count < 2) { /* each group as its own product */
        for (int i = 0; i < count; i++) {
            const mm_group *m = &groups[i];
            if (matmul(m->type, m->w, m->row_bytes, n_out, k, x + (size_t)m->t0 * k, m->t1 - m->t0,
                       y + (size_t)m->t0 * n_out) < 0)
                return -1;
        }
        return 0;
    }
    mm_input *in = calloc((size_t)count, sizeof *in);
    int *fill_first = malloc(((size_t)count + 1) * sizeof(int));
    int *first = malloc(((size_t)count + 1) * sizeof(int));
    int *rows = malloc((size_t)count * sizeof(int));
    int rc = -1, prepared = 0;
    if (in == NULL || fill_first == NULL || first == NULL || rows == NULL) goto done;
    fill_first[0] = first[0] = 0;
    for (int i = 0; i < count; i++, prepared++) {
        const mm_group *m = &groups[i];
        const int n = m->t1 - m->t0;
        if (mm_alloc(m->type, k, n, &in[i]) < 0) goto done;
        fill_first[i + 1] = fill_first[i] + (n + FILL_TOKENS - 1) / FILL_TOKENS;
        rows[i] = task_rows(n_out, m->row_bytes, n, threads);
        first[i + 1] = first[i] + (n_out + rows[i] - 1) / rows[i];
    }
    groups_job job = {groups, in, x, y, n_out, k, count, fill_first, first, rows};
    rc = pool_run(groups_fill_task, &job, fill_first[count]);
    if (rc == 0) rc = pool_run(groups_task, &job, first[count]);
done:
    for (int i = 0; i < prepared; i++) mm_free(&in[i]);
    free(in);
    free(fill_first);
    free(first);
    free(rows);
    return rc;
}
