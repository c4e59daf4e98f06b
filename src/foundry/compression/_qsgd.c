/* QSGD's encoder in one pass per bucket (foundry.compression.qsgd has the numpy version, the
 * layout and the maths; docs/protocol.md, "QSGD").
 *
 * encode(v, d, s, seed, scales, stream, decoded): v holds n float32 values, scales receives
 * ceil(n / d) float32 bucket scales (the largest magnitude of each bucket), stream the
 * ceil(n b / 8) bytes of b = 1 + bit_length(s) bit codes (level << 1 | sign, LSB first) and
 * decoded, if not None, the n values a receiver decodes (sign * level * (scale / s), the same
 * float32 roundings as the numpy decoder). Returns None; ValueError for NaN or inf input.
 *
 * decode(stream, d, s, scales, out): the values of a tensor whose bytes the caller checked, the
 * same float32 roundings as the numpy decoder.
 *
 * Stochastic rounding draws u in [0, 1) with 24 random bits (as numpy's float32 random does)
 * from xoshiro256** seeded by splitmix64(seed): the draws differ from the numpy encoder's, the
 * bytes follow the same layout and decode the same way.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

typedef struct {
    uint64_t s[4];
} rng_t;

static inline uint64_t next64(rng_t *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

static int bit_length(int s) {
    int b = 0;
    while (s) {
        b++;
        s >>= 1;
    }
    return b;
}

/* Codes into the LSB-first stream at bit offset 0 of `out` (`count` codes of `bits` bits;
 * `count` is a multiple of 8 except for the last bucket), carrying partial bytes in *acc. */
static uint8_t *pack(const uint8_t *codes, Py_ssize_t count, int bits, uint64_t *acc, int *held,
                     uint8_t *out) {
    Py_ssize_t i = 0;
    if (*held == 0) {
        if (bits == 8) {
            memcpy(out, codes, (size_t)count);
            return out + count;
        }
        if (bits == 4)
            for (; i + 2 <= count; i += 2) *out++ = (uint8_t)(codes[i] | (codes[i + 1] << 4));
        else if (bits == 2)
            for (; i + 4 <= count; i += 4)
                *out++ = (uint8_t)(codes[i] | (codes[i + 1] << 2) | (codes[i + 2] << 4) |
                                   (codes[i + 3] << 6));
    }
    for (; i < count; i++) {
        *acc |= (uint64_t)codes[i] << *held;
        *held += bits;
        while (*held >= 8) {
            *out++ = (uint8_t)*acc;
            *acc >>= 8;
            *held -= 8;
        }
    }
    return out;
}

/* Returns 0, or -1 for a non-finite value. */
static int encode_all(const float *v, Py_ssize_t n, Py_ssize_t d, int s, uint64_t seed,
                      float *scales, uint8_t *stream, float *decoded) {
    rng_t rng;
    uint64_t sm = seed;
    for (int i = 0; i < 4; i++) rng.s[i] = splitmix64(&sm);
    const int bits = 1 + bit_length(s);
    const float fs = (float)s;
    uint64_t acc = 0; /* bits not yet written, LSB first */
    int held = 0;
    uint8_t *out = stream;
    enum { CHUNK = 4096 };
    uint8_t codes[CHUNK];
    float u[CHUNK + 1], r[CHUNK];
    int32_t lv[CHUNK];
    for (Py_ssize_t b0 = 0; b0 < n; b0 += d) {
        const Py_ssize_t len = (n - b0 < d) ? n - b0 : d;
        const float *x = v + b0;
        float m = 0.0f;
        int bad = 0;
        for (Py_ssize_t i = 0; i < len; i++) {
            float a = fabsf(x[i]);
            bad |= !(a <= 3.4028235e38f); /* NaN or inf */
            m = a > m ? a : m;
        }
        if (bad) return -1;
        scales[b0 / d] = m;
        const float inv = m > 0.0f ? fs / m : 0.0f;
        const int tiny = !(inv <= 3.4028235e38f); /* s / m overflowed: divide instead */
        const float unit = m / fs;
        for (Py_ssize_t c0 = 0; c0 < len; c0 += CHUNK) {
            const Py_ssize_t cl = (len - c0 < CHUNK) ? len - c0 : CHUNK;
            const float *xc = x + c0;
            /* The draws first (a serial generator), then loops the compiler vectorizes. */
            for (Py_ssize_t i = 0; i < cl; i += 2) {
                uint64_t draws = next64(&rng);
                u[i] = (float)(draws >> 40) * (1.0f / 16777216.0f);
                u[i + 1] = (float)((draws >> 16) & 0xFFFFFF) * (1.0f / 16777216.0f);
            }
            if (tiny)
                for (Py_ssize_t i = 0; i < cl; i++) r[i] = fabsf(xc[i]) / m * fs;
            else
                for (Py_ssize_t i = 0; i < cl; i++) r[i] = fabsf(xc[i]) * inv;
            for (Py_ssize_t i = 0; i < cl; i++) {
                int level = (int)(r[i] + u[i]); /* floor: r + u >= 0 */
                level = level > s ? s : level;
                int sign = signbit(xc[i]) ? 1 : 0;
                codes[i] = (uint8_t)((level << 1) | sign);
                lv[i] = sign ? -level : level;
            }
            if (decoded)
                for (Py_ssize_t i = 0; i < cl; i++) decoded[b0 + c0 + i] = (float)lv[i] * unit;
            out = pack(codes, cl, bits, &acc, &held, out);
        }
    }
    if (held > 0) *out++ = (uint8_t)acc;
    return 0;
}

static PyObject *py_encode(PyObject *self, PyObject *args) {
    Py_buffer v, scales, stream, decoded;
    Py_ssize_t d;
    int s;
    unsigned long long seed;
    PyObject *decoded_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*niKw*w*O", &v, &d, &s, &seed, &scales, &stream, &decoded_obj))
        return NULL;
    PyObject *result = NULL;
    int have_decoded = 0;
    const Py_ssize_t n = v.len / 4;
    if (d < 1 || s < 1 || s > 127 || v.len % 4) {
        PyErr_SetString(PyExc_ValueError, "need d >= 1, 1 <= s <= 127 and float32 input");
        goto done;
    }
    if (decoded_obj != Py_None) {
        if (PyObject_GetBuffer(decoded_obj, &decoded, PyBUF_WRITABLE) < 0) goto done;
        have_decoded = 1;
    }
    const int bits = 1 + bit_length(s);
    if (scales.len != ((n + d - 1) / d) * 4 || stream.len != (n * bits + 7) / 8 ||
        (have_decoded && decoded.len != n * 4)) {
        PyErr_SetString(PyExc_ValueError, "output buffers of the wrong size");
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc =
        encode_all((const float *)v.buf, n, d, s, (uint64_t)seed, (float *)scales.buf,
                   (uint8_t *)stream.buf, have_decoded ? (float *)decoded.buf : NULL);
    Py_END_ALLOW_THREADS if (rc < 0) {
        PyErr_SetString(PyExc_ValueError, "QSGD input holds NaN or inf");
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    if (have_decoded) PyBuffer_Release(&decoded);
    PyBuffer_Release(&v);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&stream);
    return result;
}

/* decode(stream, d, s, scales, out): the n = len(out) / 4 values of a QSGD tensor (the caller
 * checked its sizes and scales). Returns 0, or -1 for a level above s. */
static int decode_all(const uint8_t *stream, Py_ssize_t n, Py_ssize_t d, int s, const float *scales,
                      float *out) {
    const int bits = 1 + bit_length(s);
    const float fs = (float)s;
    const unsigned ncodes = 1u << bits;
    float signed_level[256];
    for (unsigned c = 0; c < ncodes; c++)
        signed_level[c] = (float)((c & 1) ? -(int)(c >> 1) : (int)(c >> 1));
    /* Codes first (one pass over the stream), then the values bucket by bucket. */
    uint64_t acc = 0;
    int held = 0;
    const uint64_t mask = (1u << bits) - 1u;
    int worst = 0;
    enum { CHUNK = 4096 };
    uint8_t c[CHUNK];
    Py_ssize_t done = 0;
    while (done < n) {
        const Py_ssize_t cl = (n - done < CHUNK) ? n - done : CHUNK;
        Py_ssize_t i = 0;
        if (bits == 8) {
            memcpy(c, stream, (size_t)cl);
            stream += cl;
            i = cl;
        } else if (bits == 4 && held == 0) {
            for (; i + 2 <= cl; i += 2, stream++) {
                c[i] = *stream & 15;
                c[i + 1] = *stream >> 4;
            }
        } else if (bits == 2 && held == 0) {
            for (; i + 4 <= cl; i += 4, stream++) {
                c[i] = *stream & 3;
                c[i + 1] = (*stream >> 2) & 3;
                c[i + 2] = (*stream >> 4) & 3;
                c[i + 3] = *stream >> 6;
            }
        }
        for (; i < cl; i++) {
            if (held < bits) {
                acc |= (uint64_t)(*stream++) << held;
                held += 8;
            }
            c[i] = (uint8_t)(acc & mask);
            acc >>= bits;
            held -= bits;
        }
        for (Py_ssize_t k = 0; k < cl; k++) {
            int level = c[k] >> 1;
            worst = level > worst ? level : worst;
        }
        /* Values: this chunk may span buckets. */
        for (Py_ssize_t k = 0; k < cl;) {
            const Py_ssize_t at = done + k;
            const Py_ssize_t bucket_end = (at / d + 1) * d;
            const Py_ssize_t stop = (bucket_end - done < cl) ? bucket_end - done : cl;
            const float unit = scales[at / d] / fs;
            for (; k < stop; k++) out[done + k] = signed_level[c[k]] * unit;
        }
        done += cl;
    }
    return worst > s ? -1 : 0;
}

static PyObject *py_decode(PyObject *self, PyObject *args) {
    Py_buffer stream, scales, out;
    Py_ssize_t d;
    int s;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*niy*w*", &stream, &d, &s, &scales, &out)) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = out.len / 4;
    const int bits = 1 + bit_length(s);
    if (d < 1 || s < 1 || s > 127 || out.len % 4 || scales.len != ((n + d - 1) / d) * 4 ||
        stream.len < (n * bits + 7) / 8) {
        PyErr_SetString(PyExc_ValueError, "QSGD decode: buffers of the wrong size");
        goto done;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = decode_all((const uint8_t *)stream.buf, n, d, s,
                                           (const float *)scales.buf, (float *)out.buf);
    Py_END_ALLOW_THREADS if (rc < 0) {
        PyErr_Format(PyExc_ValueError, "QSGD level above s=%d", s);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&stream);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", py_decode, METH_VARARGS,
     "decode(stream, d, s, scales, out): a checked QSGD tensor's values into out"},
    {"encode", py_encode, METH_VARARGS,
     "encode(v, d, s, seed, scales, stream, decoded_or_None): QSGD's encoder, in place"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_qsgd", "QSGD's encoder in C (foundry.compression.qsgd).", -1, methods,
};

PyMODINIT_FUNC PyInit__qsgd(void) {
    return PyModule_Create(&module);
}
