"""Q4_K and Q6_K written as llama.cpp's reference quantizers write them, byte for byte.

The spec is ``quantize_row_q4_K_ref`` and ``quantize_row_q6_K_ref`` of ggml's
``ggml-quants.c`` (with ``make_qkx2_quants`` and ``make_qx_quants``): per block of 256 values,
sub-block scales (and Q4_K's mins) found by a small search that weighs each value, then the
sub-block scales quantized to 6 bits (Q4_K) or 8 (Q6_K) against one float16 super-scale, then
every value rounded against its sub-block's final scale. This module runs the same float32
operations in the same order (sums accumulated value by value, not pairwise, and no fused
multiply-add, as ggml's portable C compiled without FMA), vectorised across sub-blocks, so a
merged tensor of a Q4_K_M file is stored as ``llama-quantize`` would store it.
``tests/test_kquants.py`` compares the bytes with the C reference where one is built.

Layouts (ggml's ``block_q4_K`` 144 bytes, ``block_q6_K`` 210 bytes a block of 256):
- Q4_K: d f16, dmin f16, scales[12] (eight 6-bit scales and eight 6-bit mins packed), qs[128]
  (two 4-bit values a byte: values l and l + 32 of each 64);
- Q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d f16.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

# float32 arrays (numpy's stubs widen some float32 expressions to float64; the values are not)
F32 = npt.NDArray[np.floating[Any]]
U8 = npt.NDArray[np.uint8]
QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)
f32 = np.float32


def nearest_int(v: F32) -> npt.NDArray[np.int64]:
    """ggml's nearest_int: round half to even (its float trick), as int64."""
    return np.rint(v.astype(np.float32)).astype(np.int64)


def _f16(v: F32) -> tuple[npt.NDArray[np.float16], F32]:
    """A float32 value as ggml stores it (float16, to nearest even) and read back."""
    h = v.astype(np.float16)
    return h, h.astype(np.float32)


# -- Q4_K ------------------------------------------------------------------------------------


def _make_qkx2(
    x: F32, weights: F32, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[F32, F32, npt.NDArray[np.int64]]:
    """make_qkx2_quants (use_mad false) of each row of x (rows, n): (scale, the_min, L)."""
    rows, n = x.shape
    mn = x[:, 0].copy()
    mx = x[:, 0].copy()
    sum_w = weights[:, 0].copy()
    sum_x = sum_w * x[:, 0]
    for i in range(1, n):
        mn = np.where(x[:, i] < mn, x[:, i], mn)
        mx = np.where(x[:, i] > mx, x[:, i], mx)
        sum_w = sum_w + weights[:, i]
        sum_x = sum_x + weights[:, i] * x[:, i]
    mn = np.where(mn > 0, f32(0), mn)
    flat = mx == mn
    span = np.where(flat, f32(1), mx - mn)
    iscale = f32(nmax) / span
    scale = f32(1) / iscale
    L = np.clip(nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
    best: F32 = np.zeros(rows, np.float32)
    for i in range(n):
        diff = scale * L[:, i].astype(np.float32) + mn - x[:, i]
        best = best + weights[:, i] * (diff * diff)
    for step in range(nstep + 1):
        # (max - min) with the min found so far: ggml's loop updates it as it goes
        den = np.where(flat, f32(1), mx - mn)
        iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / den
        laux = np.clip(nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        lf = laux.astype(np.float32)
        sum_l: F32 = np.zeros(rows, np.float32)
        sum_l2: F32 = np.zeros(rows, np.float32)
        sum_xl: F32 = np.zeros(rows, np.float32)
        for i in range(n):
            w = weights[:, i]
            sum_l = sum_l + w * lf[:, i]
            sum_l2 = sum_l2 + w * lf[:, i] * lf[:, i]
            sum_xl = sum_xl + w * lf[:, i] * x[:, i]
        d = sum_w * sum_l2 - sum_l * sum_l
        ok = d > 0
        dd = np.where(ok, d, f32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / dd
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / dd
        positive = this_min > 0
        this_min = np.where(positive, f32(0), this_min)
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
        cur: F32 = np.zeros(rows, np.float32)
        for i in range(n):
            diff = this_scale * lf[:, i] + this_min - x[:, i]
            cur = cur + weights[:, i] * (diff * diff)
        better = ok & (cur < best) & ~flat
        L = np.where(better[:, None], laux, L)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn)
    scale = np.where(flat, f32(0), scale).astype(np.float32)
    L = np.where(flat[:, None], 0, L)
    return scale, (-mn).astype(np.float32), L


def quantize_q4_k(values: npt.ArrayLike) -> U8:
    """Rows (..., k) of float values, k a multiple of 256, as Q4_K bytes (..., k / 256 * 144)."""
    a = np.ascontiguousarray(values, dtype=np.float32)
    lead, k = a.shape[:-1], a.shape[-1]
    if k % QK_K:
        raise ValueError(f"Q4_K needs rows of whole blocks of {QK_K}, got {k}")
    x = a.reshape(-1, 8, 32)  # (blocks, sub-blocks, values)
    nb = x.shape[0]
    sub = x.reshape(-1, 32)  # (blocks * 8, 32)
    sum_x2 = np.zeros(sub.shape[0], np.float32)
    for i in range(32):
        sum_x2 = sum_x2 + sub[:, i] * sub[:, i]
    av_x = np.sqrt(sum_x2 / f32(32)).astype(np.float32)
    weights = (av_x[:, None] + np.abs(sub)).astype(np.float32)
    scales, mins, L = _make_qkx2(sub, weights, 15, -1.0, 0.1, 20)
    scales, mins, L = scales.reshape(nb, 8), mins.reshape(nb, 8), L.reshape(nb, 8, 32)
    max_scale = np.zeros(nb, np.float32)
    max_min = np.zeros(nb, np.float32)
    for j in range(8):
        max_scale = np.where(scales[:, j] > max_scale, scales[:, j], max_scale)
        max_min = np.where(mins[:, j] > max_min, mins[:, j], max_min)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0)).astype(np.float32)
        inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0)).astype(np.float32)
    ls = np.minimum(63, nearest_int(inv_scale[:, None] * scales) & 0xFF)  # (nb, 8)
    lm = np.minimum(63, nearest_int(inv_min[:, None] * mins) & 0xFF)
    packed = np.zeros((nb, 12), np.int64)
    packed[:, 0:4] = ls[:, 0:4]
    packed[:, 4:8] = lm[:, 0:4]
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    packed[:, 0:4] |= (ls[:, 4:8] >> 4) << 6
    packed[:, 4:8] |= (lm[:, 4:8] >> 4) << 6
    d16, d = _f16((max_scale / f32(63)).astype(np.float32))
    m16, dmin = _f16((max_min / f32(63)).astype(np.float32))
    sc = ls.astype(np.float32)  # get_scale_min_k4 gives back ls and lm
    m = lm.astype(np.float32)
    dj = d[:, None] * sc  # (nb, 8)
    dm = dmin[:, None] * m
    nz = dj != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(
            nearest_int((x + dm[:, :, None]) / np.where(nz, dj, f32(1))[:, :, None]), 0, 15
        )
    L = np.where(nz[:, :, None], again, L).reshape(nb, 4, 2, 32)  # (nb, 64-groups, half, 32)
    qs = (L[:, :, 0, :] | (L[:, :, 1, :] << 4)).reshape(nb, 128)
    out = np.empty((nb, 144), np.uint8)
    out[:, 0:2] = d16.view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = m16.view(np.uint8).reshape(nb, 2)
    out[:, 4:16] = packed.astype(np.uint8)
    out[:, 16:] = qs.astype(np.uint8)
    return out.reshape(*lead, k // QK_K * 144)


# -- Q6_K ------------------------------------------------------------------------------------


def _make_qx(x: F32, nmax: int) -> tuple[F32, npt.NDArray[np.int64]]:
    """make_qx_quants(n, nmax, x, L, rmse_type 1, no weights) of each row of x: (scale, L)
    with L = l + nmax."""
    rows, n = x.shape
    mx = np.zeros(rows, np.float32)
    amax = np.zeros(rows, np.float32)
    for i in range(n):
        ax = np.abs(x[:, i])
        take = ax > amax
        amax = np.where(take, ax, amax)
        mx = np.where(take, x[:, i], mx)
    zero = amax < GROUP_MAX_EPS
    safe = np.where(zero, f32(1), mx)
    w = x * x

    def sums(iscale: F32) -> tuple[npt.NDArray[np.int64], F32, F32]:
        lq = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        lf = lq.astype(np.float32)
        sumlx: F32 = np.zeros(rows, np.float32)
        suml2: F32 = np.zeros(rows, np.float32)
        for i in range(n):
            sumlx = sumlx + w[:, i] * x[:, i] * lf[:, i]
            suml2 = suml2 + w[:, i] * lf[:, i] * lf[:, i]
        return lq, sumlx, suml2

    iscale = (f32(-nmax) / safe).astype(np.float32)
    lq, sumlx, suml2 = sums(iscale)
    L = lq + nmax
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, f32(0)).astype(np.float32)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = (-(f32(nmax) + f32(0.1) * f32(step)) / safe).astype(np.float32)
        lq, sumlx, suml2 = sums(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = np.where(better[:, None], lq + nmax, L)
        with np.errstate(divide="ignore", invalid="ignore"):
            new = sumlx / suml2
        scale = np.where(better, new, scale).astype(np.float32)
        best = np.where(better, scale * sumlx, best).astype(np.float32)
    scale = np.where(zero, f32(0), scale).astype(np.float32)
    L = np.where(zero[:, None], 0, L)
    return scale, L


def quantize_q6_k(values: npt.ArrayLike) -> U8:
    """Rows (..., k) of float values, k a multiple of 256, as Q6_K bytes (..., k / 256 * 210)."""
    a = np.ascontiguousarray(values, dtype=np.float32)
    lead, k = a.shape[:-1], a.shape[-1]
    if k % QK_K:
        raise ValueError(f"Q6_K needs rows of whole blocks of {QK_K}, got {k}")
    x = a.reshape(-1, 16, 16)  # (blocks, sub-blocks, values)
    nb = x.shape[0]
    scales, L = _make_qx(x.reshape(-1, 16), 32)
    scales, L = scales.reshape(nb, 16), L.reshape(nb, 16, 16)
    max_scale = np.zeros(nb, np.float32)
    max_abs = np.zeros(nb, np.float32)
    for ib in range(16):
        take = np.abs(scales[:, ib]) > max_abs
        max_abs = np.where(take, np.abs(scales[:, ib]), max_abs)
        max_scale = np.where(take, scales[:, ib], max_scale)
    empty = max_abs < GROUP_MAX_EPS
    safe = np.where(empty, f32(1), max_scale)
    iscale = (f32(-128) / safe).astype(np.float32)
    d16, d = _f16((f32(1) / iscale).astype(np.float32))
    sc = np.minimum(127, nearest_int(iscale[:, None] * scales))  # (nb, 16), int8 range
    dj = d[:, None] * sc.astype(np.int8).astype(np.float32)
    nz = dj != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        again = np.clip(nearest_int(x / np.where(nz, dj, f32(1))[:, :, None]), -32, 31) + 32
    L = np.where(nz[:, :, None], again, L).reshape(nb, 2, 4, 32)  # (nb, 128-halves, quarter, l)
    ql = np.empty((nb, 2, 64), np.int64)
    ql[:, :, 0:32] = (L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4)
    ql[:, :, 32:64] = (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)
    qh = (
        (L[:, :, 0] >> 4)
        | ((L[:, :, 1] >> 4) << 2)
        | ((L[:, :, 2] >> 4) << 4)
        | ((L[:, :, 3] >> 4) << 6)
    )  # (nb, 2, 32)
    out = np.zeros((nb, 210), np.uint8)
    out[:, 0:128] = (ql.reshape(nb, 128) & 0xFF).astype(np.uint8)
    out[:, 128:192] = (qh.reshape(nb, 64) & 0xFF).astype(np.uint8)
    out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
    out[:, 208:210] = d16.view(np.uint8).reshape(nb, 2)
    out[empty] = 0
    return out.reshape(*lead, k // QK_K * 210)
