/* The TCP gates' byte mover in C: what tcp.py's and mesh.py's poll loops do, for plain TCP
 * sockets, without the interpreter in the loop and with the GIL released throughout.
 *
 * A gate is small (a decode partial of a 3B model is 12 KiB) and the wire is quick, so in the
 * Python loops the interpreter's own time (a send and a receive call per peer per turn, the
 * lists of buffers they take, the bookkeeping between) was a large part of a gate: about as
 * much as the wire's at N = 4 on a 1 Gb/s port (docs/benchmarks.md, "Worlds of N ranks"). The
 * bytes on the wire are the same; so are the checks (every peer's header against this rank's,
 * no byte moving for timeout_s is a stall, EOF or an error names the peer). Python keeps the
 * messages: these functions return what happened and where, and tcp.py and mesh.py raise the
 * GateError they raised before.
 *
 * - swap: the pair (tcp.py): write header + partial, read the peer's header + partial, one
 *   loop, full duplex.
 * - mesh_sum: a world of N (mesh.py): reduce-scatter, then allgather. To every peer p: header,
 *   chunk p of the partial, then (once every peer's piece of this rank's chunk r is in) the sum
 *   of chunk r; from every peer p: its header, its piece of chunk r, its sum of chunk p. Chunk
 *   r is summed in rank order, ((p0 + p1) + p2) + ..., its own piece in its place.
 *
 * - MeshGates: mesh_sum's gates inside the C one-token step (step_exchange.h), no Python at
 *   any gate: the step posts each chunk of its partial as the chunk's rows are made, so the
 *   reduce-scatter's pieces go out while the rest of the product is computed; the sums, bytes
 *   and checks are mesh_sum's. With whole=1, the pair's gates instead: swap's bytes, the sum
 *   mine + peer's.
 * - SlabGates: the pair's shared-memory gates (shm.py's rounds on the slab both ranks map)
 *   inside the C one-token step, on slabs without checksums (TSO machines).
 *
 * TLS sockets stay in Python (an ssl.SSLSocket's bytes are not the socket's). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sched.h>
#include <time.h>

#include "../../model/kernels/csrc/step_exchange.h"

/* What a move ended with (mesh.py and tcp.py read them by these values). */
enum { GATE_OK = 0, GATE_CLOSED = 1, GATE_FAILED = 2, GATE_DESYNC = 3, GATE_STALLED = 4 };

#define SEGS 3 /* buffers a direction of a peer: header, piece, sum */

typedef struct {
    int fd;
    struct iovec out[SEGS], in[SEGS];
    size_t out_step1, out_total, in_step1, in_total; /* bytes: step 1 (header, piece), all */
    size_t sent, got;
    const uint8_t *tag; /* the header this rank sends, which the peer's must equal */
    uint8_t *peer_tag;  /* where the peer's header lands (in[0]) */
    double done_s;      /* seconds from the start until every byte from this peer was in */
} peer_io;

typedef struct {
    int code, peer, err; /* peer: an index into the peers; err: errno of GATE_FAILED */
} move_result;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The bytes [from, to) of the buffers iov[0 .. SEGS - 1] as iovecs in dst; their count. */
static int span(const struct iovec *iov, size_t from, size_t to, struct iovec *dst) {
    int n = 0;
    size_t at = 0;
    for (int i = 0; i < SEGS; i++) {
        size_t lo = from > at ? from - at : 0,
               hi = to - at < iov[i].iov_len ? to - at : iov[i].iov_len;
        if (to > at && lo < hi) {
            dst[n].iov_base = (uint8_t *)iov[i].iov_base + lo;
            dst[n].iov_len = hi - lo;
            n++;
        }
        at += iov[i].iov_len;
    }
    return n;
}

/* Moves every peer's bytes: each peer's out up to out_step1, then (after `between` has run,
 * once every peer's in_step1 bytes are in) the rest; every peer's in to in_total. Spins on
 * the non-blocking sockets for spin_s without progress, then sleeps in poll(). */
static move_result move(peer_io *peers, int n, double timeout_s, double spin_s,
                        void (*between)(void *), void *ctx, struct pollfd *pfd) {
    const double t0 = now_s();
    double last = t0;
    int stepped = between == NULL;
    struct iovec iov[SEGS];
    for (;;) {
        int progress = 0, all_step1 = 1, done = 1;
        for (int i = 0; i < n; i++) {
            peer_io *p = &peers[i];
            const size_t limit = stepped ? p->out_total : p->out_step1;
            if (p->sent < limit) {
                struct msghdr m = {0};
                m.msg_iov = iov;
                m.msg_iovlen = (size_t)span(p->out, p->sent, limit, iov);
                const ssize_t k = sendmsg(p->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
                if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                    return (move_result){GATE_FAILED, i, errno};
                }
                if (k > 0) {
                    p->sent += (size_t)k;
                    progress = 1;
                }
            }
            if (p->got < p->in_total) {
                struct msghdr m = {0};
                m.msg_iov = iov;
                m.msg_iovlen = (size_t)span(p->in, p->got, p->in_total, iov);
                const ssize_t k = recvmsg(p->fd, &m, MSG_DONTWAIT);
                if (k == 0) {
                    return (move_result){GATE_CLOSED, i, 0};
                }
                if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                    return (move_result){GATE_FAILED, i, errno};
                }
                if (k > 0) {
                    const size_t head = p->in[0].iov_len;
                    if (p->got < head && head <= p->got + (size_t)k &&
                        memcmp(p->peer_tag, p->tag, head) != 0) {
                        p->got += (size_t)k;
                        return (move_result){GATE_DESYNC, i, 0};
                    }
                    p->got += (size_t)k;
                    progress = 1;
                    if (p->got == p->in_total) p->done_s = now_s() - t0;
                }
            }
            all_step1 &= p->got >= p->in_step1;
            done &= p->sent == p->out_total && p->got == p->in_total;
        }
        if (!stepped && all_step1) {
            between(ctx);
            stepped = progress = 1;
            done = 0;
        }
        if (done) return (move_result){GATE_OK, -1, 0};
        const double t = now_s();
        if (progress) {
            last = t;
            continue;
        }
        if (t - last <= spin_s) continue;
        const double left = last + timeout_s - t;
        if (left <= 0) {
            return (move_result){GATE_STALLED, -1, 0};
        }
        int m = 0;
        for (int i = 0; i < n; i++) {
            const size_t limit = stepped ? peers[i].out_total : peers[i].out_step1;
            const short ev = (short)((peers[i].sent < limit ? POLLOUT : 0) |
                                     (peers[i].got < peers[i].in_total ? POLLIN : 0));
            if (ev) {
                pfd[m].fd = peers[i].fd, pfd[m].events = ev, pfd[m].revents = 0;
                m++;
            }
        }
        poll(pfd, (nfds_t)m, (int)(left * 1000) + 1);
    }
}

static void set_iov(struct iovec *v, const void *base, size_t len) {
    v->iov_base = (void *)base;
    v->iov_len = len;
}

/* What the loops return to Python: (code, peer index, errno, and a value a peer: bytes in,
 * bytes out, seconds until every byte from it was in). */
static PyObject *result(move_result r, const peer_io *peers, int n) {
    PyObject *got = PyTuple_New(n), *sent = PyTuple_New(n), *done = PyTuple_New(n);
    if (got == NULL || sent == NULL || done == NULL) {
        Py_XDECREF(got);
        Py_XDECREF(sent);
        Py_XDECREF(done);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        PyTuple_SET_ITEM(got, i, PyLong_FromSize_t(peers[i].got));
        PyTuple_SET_ITEM(sent, i, PyLong_FromSize_t(peers[i].sent));
        PyTuple_SET_ITEM(done, i, PyFloat_FromDouble(peers[i].done_s));
    }
    return Py_BuildValue("(iiiNNN)", r.code, r.peer, r.err, got, sent, done);
}

static const char swap_doc[] =
    "swap(fd, tag, mine, peer_tag, peer, timeout_s, spin_s)\n"
    "    -> (code, peer, errno, got, sent, done)\n"
    "\n"
    "The pair's gate on a connected non-blocking TCP socket: send tag + mine, receive the\n"
    "peer's header into peer_tag and its partial into peer (writable, len(mine) bytes). code\n"
    "0 done, 1 the peer closed, 2 a socket error (errno), 3 the peer's header differs from tag\n"
    "(in peer_tag), 4 no byte moved for timeout_s; got and sent: bytes in from and out to the\n"
    "peer, done: seconds until every byte from it was in; a tuple of one value each.";

static PyObject *py_swap(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    Py_buffer tag, mine, peer_tag, peer;
    double timeout_s, spin_s;
    if (!PyArg_ParseTuple(args, "iy*y*w*w*dd", &fd, &tag, &mine, &peer_tag, &peer, &timeout_s,
                          &spin_s))
        return NULL;
    PyObject *out = NULL;
    if (peer_tag.len != tag.len || peer.len != mine.len) {
        PyErr_SetString(PyExc_ValueError, "swap: the peer's buffers must match tag and mine");
        goto done;
    }
    peer_io p = {0};
    p.fd = fd;
    p.tag = tag.buf, p.peer_tag = peer_tag.buf;
    set_iov(&p.out[0], tag.buf, (size_t)tag.len);
    set_iov(&p.out[1], mine.buf, (size_t)mine.len);
    set_iov(&p.in[0], peer_tag.buf, (size_t)tag.len);
    set_iov(&p.in[1], peer.buf, (size_t)mine.len);
    p.out_step1 = p.out_total = p.in_step1 = p.in_total = (size_t)(tag.len + mine.len);
    struct pollfd pfd[1];
    move_result r;
    Py_BEGIN_ALLOW_THREADS r = move(&p, 1, timeout_s, spin_s, NULL, NULL, pfd);
    Py_END_ALLOW_THREADS out = result(r, &p, 1);
done:
    PyBuffer_Release(&tag);
    PyBuffer_Release(&mine);
    PyBuffer_Release(&peer_tag);
    PyBuffer_Release(&peer);
    return out;
}

/* mesh_sum's state between the two steps. */
typedef struct {
    int world, rank, rows, width; /* width: this rank's chunk's columns */
    const float *own;             /* this rank's piece of its chunk (rows x width) */
    float *const *pieces;         /* by rank (own's slot unused): the peers' pieces */
    float *total;                 /* the chunk's sum (rows x width) */
} mesh_ctx;

static void mesh_reduce(void *arg) {
    const mesh_ctx *c = arg;
    const size_t m = (size_t)c->rows * (size_t)c->width;
    const float *p0 = c->rank == 0 ? c->own : c->pieces[0];
    const float *p1 = c->rank == 1 ? c->own : c->pieces[1];
    for (size_t i = 0; i < m; i++) c->total[i] = p0[i] + p1[i];
    for (int r = 2; r < c->world; r++) {
        const float *q = r == c->rank ? c->own : c->pieces[r];
        for (size_t i = 0; i < m; i++) c->total[i] += q[i];
    }
}

/* Columns [a, b) of rows x n float32 at x into dst (rows x (b - a)), or back (to_x). */
static void columns(float *x, int rows, int n, int a, int b, float *dst, int to_x) {
    const size_t w = (size_t)(b - a);
    for (int t = 0; t < rows; t++) {
        float *row = x + (size_t)t * (size_t)n + a;
        if (to_x)
            memcpy(row, dst + (size_t)t * w, w * sizeof(float));
        else
            memcpy(dst + (size_t)t * w, row, w * sizeof(float));
    }
}

static const char mesh_sum_doc[] =
    "mesh_sum(fds, rank, tag, mine, rows, out, peer_tags, timeout_s, spin_s)\n"
    "    -> (code, peer, errno, got, sent, done)\n"
    "\n"
    "A world's gate on connected non-blocking TCP sockets: fds by rank (this rank's entry\n"
    "ignored), mine and out float32 (rows, n_embd), C-contiguous; peer_tags a writable header-\n"
    "sized buffer for each other rank, in rank order. Reduce-scatter then allgather over the N\n"
    "chunks [r n_embd // N, (r + 1) n_embd // N); out gets the world's sum. code, peer (an index\n"
    "into the other ranks, in rank order), errno, got, sent and done as swap's, a value per\n"
    "other rank.";

static PyObject *py_mesh_sum(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *fds, *tags_seq;
    int rank, rows;
    Py_buffer tag, mine, out;
    double timeout_s, spin_s;
    if (!PyArg_ParseTuple(args, "Oiy*y*iw*Odd", &fds, &rank, &tag, &mine, &rows, &out, &tags_seq,
                          &timeout_s, &spin_s))
        return NULL;
    PyObject *ret = NULL, *fast_fds = NULL, *fast_tags = NULL;
    Py_buffer *tags = NULL;
    int n_tags = 0, world = 0, *fd = NULL;
    float *mem = NULL, **pieces = NULL;
    peer_io *peers = NULL;
    struct pollfd *pfd = NULL;
    const size_t head = (size_t)tag.len;
    fast_fds = PySequence_Fast(fds, "fds must be a sequence");
    fast_tags = PySequence_Fast(tags_seq, "peer_tags must be a sequence");
    if (fast_fds == NULL || fast_tags == NULL) goto done;
    world = (int)PySequence_Fast_GET_SIZE(fast_fds);
    if (world < 2 || rank < 0 || rank >= world || rows <= 0 || mine.len != out.len ||
        mine.len % ((Py_ssize_t)rows * 4) != 0 ||
        PySequence_Fast_GET_SIZE(fast_tags) != world - 1) {
        PyErr_SetString(PyExc_ValueError,
                        "mesh_sum: fds, rank, rows, buffers or peer_tags do not agree");
        goto done;
    }
    const int n = (int)(mine.len / ((Py_ssize_t)rows * 4)); /* n_embd */
    /* Chunk bounds, and room: one row needs only the peers' pieces (the chunks of mine and out
     * are contiguous); several need each chunk gathered (sent: mine's, sums: the peers' sums,
     * chunk c at rows * c's first column). */
    const int a = rank * n / world, b = (rank + 1) * n / world;
    const size_t cells = (size_t)rows * (size_t)(b - a), whole = (size_t)rows * (size_t)n;
    const int gather = rows > 1;
    const size_t room = (size_t)(world - 1) * cells + (gather ? cells + 2 * whole : 0);
    tags = calloc((size_t)world, sizeof(Py_buffer));
    peers = calloc((size_t)world, sizeof(peer_io));
    pfd = calloc((size_t)world, sizeof(struct pollfd));
    fd = calloc((size_t)world, sizeof(int));
    pieces = calloc((size_t)world, sizeof(float *));
    mem = malloc((room ? room : 1) * sizeof(float));
    if (tags == NULL || peers == NULL || pfd == NULL || fd == NULL || pieces == NULL ||
        mem == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int r = 0; r < world; r++) {
        fd[r] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(fast_fds, r));
        if (fd[r] == -1 && PyErr_Occurred()) goto done;
    }
    for (; n_tags < world - 1; n_tags++) {
        Py_buffer *t = &tags[n_tags];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast_tags, n_tags), t, PyBUF_WRITABLE) < 0)
            goto done;
        if ((size_t)t->len != head) {
            n_tags++;
            PyErr_SetString(PyExc_ValueError, "mesh_sum: a peer_tags buffer is not a header");
            goto done;
        }
    }
    float *at = mem;
    float *const x = mine.buf, *const y = out.buf;
    float *total = y + a, *own = x + a, *sent = x, *sums = y;
    if (gather) {
        total = at, at += cells;
        sent = at, at += whole;
        sums = at, at += whole;
        own = sent + (size_t)rows * (size_t)a;
        columns(x, rows, n, a, b, own, 0);
    }
    for (int r = 0, i = 0; r < world; r++) {
        if (r == rank) continue;
        const int c0 = r * n / world, c1 = (r + 1) * n / world;
        const size_t pc = (size_t)rows * (size_t)(c1 - c0);
        float *piece = gather ? sent + (size_t)rows * (size_t)c0 : x + c0;
        float *sum = gather ? sums + (size_t)rows * (size_t)c0 : y + c0;
        if (gather) columns(x, rows, n, c0, c1, piece, 0);
        pieces[r] = at, at += cells;
        peer_io *p = &peers[i];
        p->fd = fd[r];
        p->tag = tag.buf, p->peer_tag = tags[i].buf;
        set_iov(&p->out[0], tag.buf, head);
        set_iov(&p->out[1], piece, pc * 4);
        set_iov(&p->out[2], total, cells * 4);
        set_iov(&p->in[0], tags[i].buf, head);
        set_iov(&p->in[1], pieces[r], cells * 4);
        set_iov(&p->in[2], sum, pc * 4);
        p->out_step1 = head + pc * 4, p->out_total = p->out_step1 + cells * 4;
        p->in_step1 = head + cells * 4, p->in_total = p->in_step1 + pc * 4;
        i++;
    }
    mesh_ctx ctx = {world, rank, rows, b - a, own, pieces, total};
    move_result res;
    Py_BEGIN_ALLOW_THREADS res = move(peers, world - 1, timeout_s, spin_s, mesh_reduce, &ctx, pfd);
    if (res.code == GATE_OK && gather) {
        columns(y, rows, n, a, b, total, 1);
        for (int q = 0; q < world; q++)
            if (q != rank) {
                const int c0 = q * n / world, c1 = (q + 1) * n / world;
                columns(y, rows, n, c0, c1, sums + (size_t)rows * (size_t)c0, 1);
            }
    }
    Py_END_ALLOW_THREADS ret = result(res, peers, world - 1);
done:
    for (int t = 0; t < n_tags; t++) PyBuffer_Release(&tags[t]);
    free(tags);
    free(peers);
    free(pfd);
    free(fd);
    free(pieces);
    free(mem);
    Py_XDECREF(fast_fds);
    Py_XDECREF(fast_tags);
    PyBuffer_Release(&tag);
    PyBuffer_Release(&mine);
    PyBuffer_Release(&out);
    return ret;
}

/* ---- a world's gates inside the one-token step ---------------------------------------------- */

#define HEAD 20 /* the gate header, wire.tp GATE_HEADER "<HBBQII": layer, gate, 0, seq, rows, n */

/* A step's gates: how many ran, and the seconds of the first `room` of them (start's
 * max_gates). MeshGates and SlabGates each keep one. */
typedef struct {
    double *seconds;
    int count, room;
} gate_log;

/* A new step's log with room for max_gates gates; -1 with an exception if not. */
static int log_start(gate_log *g, int max_gates) {
    if (max_gates < 0) {
        PyErr_SetString(PyExc_ValueError, "start: max_gates < 0");
        return -1;
    }
    if (max_gates > g->room) {
        double *more = realloc(g->seconds, (size_t)max_gates * sizeof(double));
        if (more == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        g->seconds = more, g->room = max_gates;
    }
    g->count = 0;
    return 0;
}

static void log_gate(gate_log *g, double seconds) {
    if (g->count < g->room) g->seconds[g->count] = seconds;
    g->count++;
}

/* The seconds kept, as a tuple (records()' second value). */
static PyObject *log_seconds(const gate_log *g) {
    const int kept = g->count < g->room ? g->count : g->room;
    PyObject *t = PyTuple_New(kept);
    if (t == NULL) return NULL;
    for (int i = 0; i < kept; i++) PyTuple_SET_ITEM(t, i, PyFloat_FromDouble(g->seconds[i]));
    return t;
}

typedef struct {
    PyObject_HEAD int world, rank, n; /* n: n_embd */
    int whole;                        /* the pair's swap: the whole partial each way */
    double timeout_s, spin_s;
    uint64_t seq; /* the next gate's */
    int *fd;      /* by rank */
    Py_buffer *tags;
    int n_tags;
    peer_io *peers; /* the other ranks, in rank order */
    struct pollfd *pfd;
    float *mem, **pieces, *total, *sums; /* pieces by rank; total: this rank's chunk; sums: n */
    int open;                            /* a gate begun and not yet moved */
    uint8_t tag[HEAD];
    gate_log log;   /* this step's gates */
    double *wait_s; /* this step's waits for each peer */
    int failed;
    move_result failure;
    step_exchange xch;
} MeshGates;

static int mesh_chunk(const MeshGates *m, int c) {
    return (int)((int64_t)c * m->n / m->world);
}

static void put_le(uint8_t *at, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) at[i] = (uint8_t)(v >> (8 * i));
}

/* One gate's header (wire.tp GATE_HEADER) in tag, for one row of n. */
static void gate_tag(uint8_t *tag, int layer, int gate, uint64_t seq, int n) {
    put_le(tag, (uint64_t)layer, 2);
    put_le(tag + 2, (uint64_t)gate, 1);
    put_le(tag + 3, 0, 1);
    put_le(tag + 4, seq, 8);
    put_le(tag + 12, 1, 4);
    put_le(tag + 16, (uint64_t)n, 4);
}

/* step_exchange.begin: the gate's header, and every peer's buffers over `partial`. */
static void mesh_begin(void *ctx, int layer, int gate, const float *partial) {
    MeshGates *m = ctx;
    gate_tag(m->tag, layer, gate, m->seq, m->n);
    const size_t cells = (size_t)(mesh_chunk(m, m->rank + 1) - mesh_chunk(m, m->rank));
    for (int r = 0, i = 0; r < m->world; r++) {
        if (r == m->rank) continue;
        const int c0 = mesh_chunk(m, r);
        const size_t pc = (size_t)(mesh_chunk(m, r + 1) - c0);
        peer_io *p = &m->peers[i];
        *p = (peer_io){0};
        p->fd = m->fd[r];
        p->tag = m->tag, p->peer_tag = m->tags[i].buf;
        set_iov(&p->out[0], m->tag, HEAD);
        set_iov(&p->out[1], partial + c0, pc * 4);
        set_iov(&p->out[2], m->total, cells * 4);
        set_iov(&p->in[0], m->tags[i].buf, HEAD);
        set_iov(&p->in[1], m->pieces[r], cells * 4);
        set_iov(&p->in[2], m->sums + c0, pc * 4);
        p->out_step1 = HEAD + pc * 4, p->out_total = p->out_step1 + cells * 4;
        p->in_step1 = HEAD + cells * 4, p->in_total = p->in_step1 + pc * 4;
        i++;
    }
    m->open = 1;
}

/* step_exchange.post: chunk c of the partial is final; its peer gets header + chunk now, as
 * far as the socket takes them (move() sends the rest and reports any error). */
static void mesh_post(void *ctx, int c) {
    MeshGates *m = ctx;
    if (!m->open || c == m->rank || c < 0 || c >= m->world) return;
    peer_io *p = &m->peers[c < m->rank ? c : c - 1];
    if (p->sent >= p->out_step1) return;
    struct iovec iov[SEGS];
    struct msghdr msg = {0};
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)span(p->out, p->sent, p->out_step1, iov);
    const ssize_t k = sendmsg(p->fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) p->sent += (size_t)k;
}

/* A gate's bookkeeping once its bytes moved: its seconds, the peers' waits, the next seq. */
static void mesh_count(MeshGates *m, double t0) {
    log_gate(&m->log, now_s() - t0);
    for (int i = 0; i < m->world - 1; i++) m->wait_s[i] += m->peers[i].done_s;
    m->seq++;
}

/* A pair's total: sum (mine, n floats) += peer, the sum mine + peer's that tcp.py and shm.py
 * make; then peer holds the total too (records()' last). */
static void add_peer(float *sum, float *peer, int n) {
    for (int i = 0; i < n; i++) sum[i] += peer[i];
    memcpy(peer, sum, (size_t)n * sizeof(float));
}

/* The pair's gate (whole): swap's bytes, header + the whole partial each way; sum += the
 * peer's, which is mine + peer's, the sum tcp.py makes. */
static int pair_gate(MeshGates *m, int layer, int gate, float *sum) {
    gate_tag(m->tag, layer, gate, m->seq, m->n);
    peer_io *p = &m->peers[0];
    *p = (peer_io){0};
    p->fd = m->fd[1 - m->rank];
    p->tag = m->tag, p->peer_tag = m->tags[0].buf;
    const size_t bytes = (size_t)m->n * sizeof(float);
    set_iov(&p->out[0], m->tag, HEAD);
    set_iov(&p->out[1], sum, bytes);
    set_iov(&p->in[0], m->tags[0].buf, HEAD);
    set_iov(&p->in[1], m->sums, bytes);
    p->out_step1 = p->out_total = p->in_step1 = p->in_total = HEAD + bytes;
    const double t0 = now_s();
    const move_result r = move(m->peers, 1, m->timeout_s, m->spin_s, NULL, NULL, m->pfd);
    if (r.code != GATE_OK) {
        m->failed = 1;
        m->failure = r;
        return -1;
    }
    mesh_count(m, t0);
    add_peer(sum, m->sums, m->n);
    return 0;
}

/* step_exchange.fn: mesh_sum's gate for one row from where the posts left it; sum (n) gets
 * the world's total. 0, or -1 with the failure kept for records(). */
static int mesh_gate(void *ctx, int layer, int gate, float *sum) {
    MeshGates *m = ctx;
    if (m->failed) return -1;
    if (m->whole) return pair_gate(m, layer, gate, sum);
    if (!m->open) mesh_begin(m, layer, gate, sum);
    const int a = mesh_chunk(m, m->rank), b = mesh_chunk(m, m->rank + 1);
    mesh_ctx c = {m->world, m->rank, 1, b - a, sum + a, m->pieces, m->total};
    const double t0 = now_s();
    const move_result r =
        move(m->peers, m->world - 1, m->timeout_s, m->spin_s, mesh_reduce, &c, m->pfd);
    m->open = 0;
    if (r.code != GATE_OK) {
        m->failed = 1;
        m->failure = r;
        return -1;
    }
    mesh_count(m, t0);
    memcpy(m->sums + a, m->total, (size_t)(b - a) * sizeof(float));
    memcpy(sum, m->sums, (size_t)m->n * sizeof(float));
    return 0;
}

static void mesh_gates_dealloc(MeshGates *m) {
    for (int t = 0; t < m->n_tags; t++) PyBuffer_Release(&m->tags[t]);
    free(m->tags);
    free(m->fd);
    free(m->peers);
    free(m->pfd);
    free(m->mem);
    free(m->pieces);
    free(m->log.seconds);
    free(m->wait_s);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyObject *mesh_gates_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyObject *fds, *tags_seq;
    int rank, n, whole = 0;
    double timeout_s, spin_s;
    static char *names[] = {"fds",       "rank",   "n_embd", "peer_tags",
                            "timeout_s", "spin_s", "whole",  NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OiiOdd|p", names, &fds, &rank, &n, &tags_seq,
                                     &timeout_s, &spin_s, &whole))
        return NULL;
    PyObject *fast_fds = PySequence_Fast(fds, "fds must be a sequence"), *fast_tags = NULL;
    if (fast_fds == NULL) return NULL;
    fast_tags = PySequence_Fast(tags_seq, "peer_tags must be a sequence");
    if (fast_tags == NULL) {
        Py_DECREF(fast_fds);
        return NULL;
    }
    MeshGates *m = (MeshGates *)type->tp_alloc(type, 0);
    if (m == NULL) goto fail;
    const int world = (int)PySequence_Fast_GET_SIZE(fast_fds);
    if (world < 2 || rank < 0 || rank >= world || n <= 0 || (whole && world != 2) ||
        PySequence_Fast_GET_SIZE(fast_tags) != world - 1) {
        PyErr_SetString(PyExc_ValueError, "MeshGates: fds, rank, n_embd or peer_tags do not agree");
        goto fail;
    }
    m->world = world, m->rank = rank, m->n = n, m->whole = whole;
    m->timeout_s = timeout_s, m->spin_s = spin_s;
    const size_t cells = (size_t)(mesh_chunk(m, rank + 1) - mesh_chunk(m, rank));
    m->tags = calloc((size_t)world, sizeof(Py_buffer));
    m->fd = calloc((size_t)world, sizeof(int));
    m->peers = calloc((size_t)world, sizeof(peer_io));
    m->pfd = calloc((size_t)world, sizeof(struct pollfd));
    m->pieces = calloc((size_t)world, sizeof(float *));
    m->wait_s = calloc((size_t)world, sizeof(double));
    m->mem = malloc(((size_t)world * cells + (size_t)n + 1) * sizeof(float));
    if (m->tags == NULL || m->fd == NULL || m->peers == NULL || m->pfd == NULL ||
        m->pieces == NULL || m->wait_s == NULL || m->mem == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (int r = 0; r < world; r++) {
        m->fd[r] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(fast_fds, r));
        if (m->fd[r] == -1 && PyErr_Occurred()) goto fail;
    }
    for (; m->n_tags < world - 1; m->n_tags++) {
        Py_buffer *t = &m->tags[m->n_tags];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast_tags, m->n_tags), t, PyBUF_WRITABLE) <
            0)
            goto fail;
        if (t->len != HEAD) {
            m->n_tags++;
            PyErr_SetString(PyExc_ValueError, "MeshGates: a peer_tags buffer is not a header");
            goto fail;
        }
    }
    float *at = m->mem;
    m->total = at, at += cells;
    for (int r = 0; r < world; r++)
        if (r != rank) m->pieces[r] = at, at += cells;
    m->sums = at;
    m->xch = whole ? (step_exchange){mesh_gate, NULL, NULL, m, 0, world, rank, n}
                   : (step_exchange){mesh_gate, mesh_begin, mesh_post, m, 0, world, rank, n};
    Py_DECREF(fast_fds);
    Py_DECREF(fast_tags);
    return (PyObject *)m;
fail:
    Py_XDECREF(m);
    Py_DECREF(fast_fds);
    Py_DECREF(fast_tags);
    return NULL;
}

static void capsule_release(PyObject *capsule) {
    Py_XDECREF((PyObject *)PyCapsule_GetContext(capsule));
}

/* The capsule step_layers takes: xch, keeping its owner alive while the capsule lives. */
static PyObject *step_capsule(step_exchange *xch, PyObject *owner) {
    PyObject *capsule = PyCapsule_New(xch, STEP_EXCHANGE_CAPSULE, capsule_release);
    if (capsule == NULL) return NULL;
    if (PyCapsule_SetContext(capsule, Py_NewRef(owner)) < 0) {
        Py_DECREF(owner);
        Py_DECREF(capsule);
        return NULL;
    }
    return capsule;
}

static PyObject *mesh_gates_start(MeshGates *m, PyObject *args) {
    unsigned long long seq;
    int max_gates;
    if (!PyArg_ParseTuple(args, "Ki", &seq, &max_gates) || log_start(&m->log, max_gates) < 0)
        return NULL;
    m->seq = seq, m->failed = 0, m->open = 0;
    memset(m->wait_s, 0, (size_t)m->world * sizeof(double));
    return step_capsule(&m->xch, (PyObject *)m);
}

static PyObject *mesh_gates_records(MeshGates *m, PyObject *unused) {
    (void)unused;
    const int peers = m->world - 1;
    PyObject *gates = log_seconds(&m->log), *waits = PyTuple_New(peers), *failure = NULL;
    if (gates == NULL || waits == NULL) goto fail;
    for (int i = 0; i < peers; i++) PyTuple_SET_ITEM(waits, i, PyFloat_FromDouble(m->wait_s[i]));
    if (m->failed) {
        PyObject *got = PyTuple_New(peers), *sent = PyTuple_New(peers);
        if (got == NULL || sent == NULL) {
            Py_XDECREF(got);
            Py_XDECREF(sent);
            goto fail;
        }
        for (int i = 0; i < peers; i++) {
            PyTuple_SET_ITEM(got, i, PyLong_FromSize_t(m->peers[i].got));
            PyTuple_SET_ITEM(sent, i, PyLong_FromSize_t(m->peers[i].sent));
        }
        failure = Py_BuildValue("(iiiNNy#)", m->failure.code, m->failure.peer, m->failure.err, got,
                                sent, (const char *)m->tag, (Py_ssize_t)HEAD);
        if (failure == NULL) goto fail;
    } else {
        failure = Py_NewRef(Py_None);
    }
    PyObject *last = m->log.count && !m->failed
                         ? PyBytes_FromStringAndSize((const char *)m->sums, (Py_ssize_t)m->n * 4)
                         : Py_NewRef(Py_None);
    if (last == NULL) {
        Py_DECREF(failure);
        goto fail;
    }
    return Py_BuildValue("(KNNNN)", (unsigned long long)m->seq, gates, waits, failure, last);
fail:
    Py_XDECREF(gates);
    Py_XDECREF(waits);
    return NULL;
}

static PyMethodDef mesh_gates_methods[] = {
    {"start", (PyCFunction)mesh_gates_start, METH_VARARGS,
     "start(seq, max_gates) -> capsule: a step's gates from seq on, up to max_gates of them\n"
     "timed; the capsule (step_exchange.h) goes to step_layers and keeps this object alive."},
    {"records", (PyCFunction)mesh_gates_records, METH_NOARGS,
     "records() -> (next seq, each gate's seconds, each peer's waits in seconds, failure,\n"
     "last): the step since start. failure None, or (code, peer, errno, got, sent, tag) as\n"
     "mesh_sum's (peer an index into the other ranks; got and sent bytes in from and out to\n"
     "each; tag the failed gate's); last the last gate's total (n_embd float32 bytes), None\n"
     "if none or failed."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MeshGatesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "foundry.transport.gates._gates.MeshGates",
    .tp_basicsize = sizeof(MeshGates),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "MeshGates(fds, rank, n_embd, peer_tags, timeout_s, spin_s, whole=False):\n"
              "mesh_sum's gates of one row for the C one-token step (step_layers), on connected\n"
              "non-blocking TCP sockets (fds by rank, this rank's ignored); the peers' headers\n"
              "land in peer_tags (a writable 20-byte buffer each, in rank order), kept until\n"
              "this object goes. whole (a pair only): swap's gates instead, the whole partial\n"
              "each way and the sum mine + the peer's.",
    .tp_new = mesh_gates_new,
    .tp_dealloc = (destructor)mesh_gates_dealloc,
    .tp_methods = mesh_gates_methods,
};

/* ---- the pair's shared-memory gates inside the one-token step ------------------------------ */

/* shm.py's rounds for gates of one row (a slot holds far more), without Python: this rank's
 * partial into its slot of the round's parity by the seqlock rule (seq_begin; pub, header and
 * data; seq_end), then the peer's slot polled until seq_end shows the round and read under
 * the same rule. The barriers are C11's (release before the data and at seq_end, acquire
 * after reading), so the rule holds on any machine; slabs with checksums (made off x86) stay
 * in shm.py, whose readers check them. The offsets come from wire.tp SlabLayout. */

#define SLAB_CLOSED 2          /* wire.tp SLAB_CLOSED: a rank's state word once it left the slab */
#define STAMP       (8 + HEAD) /* pub u64, then the gate header */

typedef struct {
    PyObject_HEAD Py_buffer slab; /* the mapped file, held until this object goes */
    int rank, n;
    Py_ssize_t slot[4]; /* rank 0 parity 0, rank 0 parity 1, rank 1 parity 0, rank 1 parity 1 */
    Py_ssize_t stamp_at, data_at, seq_end_at, state_at; /* within a slot; the states' offset */
    double timeout_s, spin_s, sleep_first_s, sleep_max_s;
    uint64_t seq, pub;
    uint8_t tag[HEAD], peer_stamp[STAMP];
    float *peer;   /* the peer's partial, then the gate's total */
    gate_log log;  /* this step's gates */
    double wait_s; /* this step's waits for the peer */
    int failed, failure;
    step_exchange xch;
} SlabGates;

static uint8_t *slab_slot(const SlabGates *s, int rank) {
    return (uint8_t *)s->slab.buf + s->slot[2 * rank + (int)(s->pub % 2)];
}

static void slab_publish(SlabGates *s, const float *mine) {
    uint8_t *slot = slab_slot(s, s->rank);
    __atomic_store_n((uint64_t *)slot, s->pub, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    put_le(slot + s->stamp_at, s->pub, 8);
    memcpy(slot + s->stamp_at + 8, s->tag, HEAD);
    memcpy(slot + s->data_at, mine, (size_t)s->n * sizeof(float));
    __atomic_store_n((uint64_t *)(slot + s->seq_end_at), s->pub, __ATOMIC_RELEASE);
}

/* The peer's round into s->peer: GATE_OK, GATE_DESYNC (its stamp in peer_stamp), GATE_CLOSED
 * or GATE_STALLED, waiting as shm.py does (spin, then naps doubling up to sleep_max_s). */
static int slab_collect(SlabGates *s) {
    const int peer = 1 - s->rank;
    const uint8_t *slot = slab_slot(s, peer);
    const uint64_t *begin = (const uint64_t *)slot, *end = (const uint64_t *)(slot + s->seq_end_at);
    const uint32_t *state = (const uint32_t *)((uint8_t *)s->slab.buf + s->state_at) + peer;
    uint8_t want[STAMP];
    put_le(want, s->pub, 8);
    memcpy(want + 8, s->tag, HEAD);
    const double t0 = now_s();
    double nap = s->sleep_first_s;
    for (unsigned polls = 1;; polls++) {
        if (__atomic_load_n(end, __ATOMIC_ACQUIRE) == s->pub) {
            memcpy(s->peer_stamp, slot + s->stamp_at, STAMP);
            memcpy(s->peer, slot + s->data_at, (size_t)s->n * sizeof(float));
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (__atomic_load_n(begin, __ATOMIC_RELAXED) == s->pub &&
                __atomic_load_n(end, __ATOMIC_RELAXED) == s->pub)
                return memcmp(s->peer_stamp, want, STAMP) == 0 ? GATE_OK : GATE_DESYNC;
        }
        if (__atomic_load_n(state, __ATOMIC_RELAXED) == SLAB_CLOSED) return GATE_CLOSED;
        if (polls % 32) continue;
        const double waited = now_s() - t0;
        if (waited < s->spin_s) {
            sched_yield();
            continue;
        }
        if (waited > s->timeout_s) return GATE_STALLED;
        const struct timespec ts = {0, (long)(nap * 1e9)};
        nanosleep(&ts, NULL);
        nap = 2 * nap < s->sleep_max_s ? 2 * nap : s->sleep_max_s;
    }
}

/* step_exchange.fn: one round each way; sum += the peer's (mine + peer's, as shm.py sums). */
static int slab_gate(void *ctx, int layer, int gate, float *sum) {
    SlabGates *s = ctx;
    if (s->failed) return -1;
    gate_tag(s->tag, layer, gate, s->seq, s->n);
    const double t0 = now_s();
    slab_publish(s, sum);
    const int code = slab_collect(s);
    if (code != GATE_OK) {
        s->failed = 1;
        s->failure = code;
        return -1;
    }
    const double dt = now_s() - t0;
    log_gate(&s->log, dt);
    s->wait_s += dt;
    s->pub++;
    s->seq++;
    add_peer(sum, s->peer, s->n);
    return 0;
}

static void slab_gates_dealloc(SlabGates *s) {
    if (s->slab.obj != NULL) PyBuffer_Release(&s->slab);
    free(s->peer);
    free(s->log.seconds);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *slab_gates_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Py_buffer slab;
    int rank, n;
    Py_ssize_t slot[4], stamp_at, data_at, seq_end_at, state_at;
    double timeout_s, spin_s, sleep_first_s, sleep_max_s;
    static char *names[] = {"slab",          "rank",        "n_embd",   "slots",     "stamp_at",
                            "data_at",       "seq_end_at",  "state_at", "timeout_s", "spin_s",
                            "sleep_first_s", "sleep_max_s", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "w*ii(nnnn)nnnndddd", names, &slab, &rank, &n,
                                     &slot[0], &slot[1], &slot[2], &slot[3], &stamp_at, &data_at,
                                     &seq_end_at, &state_at, &timeout_s, &spin_s, &sleep_first_s,
                                     &sleep_max_s))
        return NULL;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    PyBuffer_Release(&slab);
    PyErr_SetString(PyExc_NotImplementedError, "SlabGates: the slab's words are little-endian");
    return NULL;
#endif
    int fits = (rank == 0 || rank == 1) && n > 0 && state_at >= 0 && state_at + 8 <= slab.len &&
               stamp_at >= 0 && stamp_at % 8 == 0 && seq_end_at % 8 == 0;
    for (int i = 0; i < 4 && fits; i++) {
        fits = slot[i] >= 0 && slot[i] % 8 == 0 && slot[i] + stamp_at + STAMP <= slab.len &&
               slot[i] + data_at + (Py_ssize_t)n * 4 <= slab.len && data_at >= stamp_at + STAMP &&
               seq_end_at >= data_at + (Py_ssize_t)n * 4 && slot[i] + seq_end_at + 8 <= slab.len;
    }
    if (!fits || (uintptr_t)slab.buf % 8 != 0) {
        PyBuffer_Release(&slab);
        PyErr_SetString(PyExc_ValueError, "SlabGates: the offsets do not fit the slab");
        return NULL;
    }
    SlabGates *s = (SlabGates *)type->tp_alloc(type, 0);
    if (s == NULL) {
        PyBuffer_Release(&slab);
        return NULL;
    }
    s->slab = slab;
    s->rank = rank, s->n = n;
    memcpy(s->slot, slot, sizeof(slot));
    s->stamp_at = stamp_at, s->data_at = data_at, s->seq_end_at = seq_end_at;
    s->state_at = state_at;
    s->timeout_s = timeout_s, s->spin_s = spin_s;
    s->sleep_first_s = sleep_first_s, s->sleep_max_s = sleep_max_s;
    s->peer = malloc((size_t)n * sizeof(float));
    if (s->peer == NULL) {
        Py_DECREF(s);
        return PyErr_NoMemory();
    }
    s->xch = (step_exchange){slab_gate, NULL, NULL, s, 0, 2, rank, n};
    return (PyObject *)s;
}

static PyObject *slab_gates_start(SlabGates *s, PyObject *args) {
    unsigned long long seq, pub;
    int max_gates;
    if (!PyArg_ParseTuple(args, "KiK", &seq, &max_gates, &pub) || log_start(&s->log, max_gates) < 0)
        return NULL;
    s->seq = seq, s->pub = pub, s->failed = 0, s->wait_s = 0;
    return step_capsule(&s->xch, (PyObject *)s);
}

static PyObject *slab_gates_records(SlabGates *s, PyObject *unused) {
    (void)unused;
    PyObject *gates = log_seconds(&s->log);
    if (gates == NULL) return NULL;
    PyObject *failure =
        s->failed ? Py_BuildValue("(iy#y#)", s->failure, (const char *)s->peer_stamp + 8,
                                  (Py_ssize_t)HEAD, (const char *)s->tag, (Py_ssize_t)HEAD)
                  : Py_NewRef(Py_None);
    PyObject *last = s->log.count && !s->failed
                         ? PyBytes_FromStringAndSize((const char *)s->peer, (Py_ssize_t)s->n * 4)
                         : Py_NewRef(Py_None);
    if (failure == NULL || last == NULL) {
        Py_DECREF(gates);
        Py_XDECREF(failure);
        Py_XDECREF(last);
        return NULL;
    }
    return Py_BuildValue("(KN(d)NN)", (unsigned long long)s->seq, gates, s->wait_s, failure, last);
}

static PyMethodDef slab_gates_methods[] = {
    {"start", (PyCFunction)slab_gates_start, METH_VARARGS,
     "start(seq, max_gates, pub) -> capsule: a step's gates from seq on, its first round pub,\n"
     "up to max_gates of them timed; the capsule (step_exchange.h) goes to step_layers and\n"
     "keeps this object alive. Each gate is one round."},
    {"records", (PyCFunction)slab_gates_records, METH_NOARGS,
     "records() -> (next seq, each gate's seconds, (the peer's waits in seconds,), failure,\n"
     "last): the step since start. failure None, or (code, the peer's header, tag), code 1\n"
     "the peer closed the slab, 3 the peer's round carried another header (or round), 4 no\n"
     "round within timeout_s; last the last gate's total (n_embd float32 bytes), None if none\n"
     "or failed."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SlabGatesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "foundry.transport.gates._gates.SlabGates",
    .tp_basicsize = sizeof(SlabGates),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SlabGates(slab, rank, n_embd, slots, stamp_at, data_at, seq_end_at, state_at,\n"
              "timeout_s, spin_s, sleep_first_s, sleep_max_s): the pair's gates of one row on\n"
              "a slab without checksums (shm.py) for the C one-token step; slab the writable\n"
              "map, slots the four slots' offsets, the others as wire.tp SlabLayout has them.",
    .tp_new = slab_gates_new,
    .tp_dealloc = (destructor)slab_gates_dealloc,
    .tp_methods = slab_gates_methods,
};

static PyMethodDef methods[] = {
    {"swap", py_swap, METH_VARARGS, swap_doc},
    {"mesh_sum", py_mesh_sum, METH_VARARGS, mesh_sum_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "_gates",
    "The TCP gates' byte mover for plain sockets (transport/gates/_gates.c).",
    -1,
    methods,
};

PyMODINIT_FUNC PyInit__gates(void) {
    if (PyType_Ready(&MeshGatesType) < 0 || PyType_Ready(&SlabGatesType) < 0) return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL) return NULL;
    if (PyModule_AddObjectRef(mod, "MeshGates", (PyObject *)&MeshGatesType) < 0 ||
        PyModule_AddObjectRef(mod, "SlabGates", (PyObject *)&SlabGatesType) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
