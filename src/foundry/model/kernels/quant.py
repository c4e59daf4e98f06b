"""Weights kept in their GGUF storage type, and the products that read them in place.

A :class:`QTensor` is a weight matrix (or a stack of expert matrices) as the file stores it:
ggml blocks along each row (the numpy last axis, ggml's ne0), ``data`` holding the raw bytes
of each row. The model never expands one to float32; :func:`linear` multiplies float32
activations with it block by block.

The products come from ``foundry.model.kernels._kernels``, a small C extension built at install time
(``setup.py``); each output is one row's dot product in one fixed order of operations, the same
on x86-64 (AVX2), arm64 and armv7 (NEON) and in the portable C, so it does not depend on the
thread count, the batch or the machine (``csrc/kernels.h`` has the definition;
``bench/determinism/cross_arch.py`` checks x86-64 against arm64 and armv7). Where the extension
is missing (no compiler at install), :func:`linear` dequantizes the weights with the ``gguf``
package and multiplies in numpy: the same results to quantization accuracy, much slower
(docs/quantization.md). ``KERNELS`` says which is in use.

Types: F16, Q8_0 and Q4_0 (what ``foundry export`` writes) and the others ``llama-quantize``'s
Q4_K_M gives our shapes: Q4_K, Q5_K, Q6_K, and the 32-blocks Q4_1, Q5_0, Q5_1 it falls back to
when a row is not a multiple of 256.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple, NewType

import gguf
import gguf.quants
import numpy as np
import numpy.typing as npt

from foundry.model.kernels.types import SUPPORTED, TYPES
from foundry.model.nn.layers import (
    attention_forward,
    combine_expert_outputs,
    expert_assignments,
    gelu_table,
    rmsnorm_forward,
    rope_forward,
    router_forward,
    silu_and_sigmoid,
)
from foundry.model.nn.layers import geglu as numpy_geglu

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]
QType = gguf.GGMLQuantizationType
Cache = tuple[npt.NDArray[Any], npt.NDArray[Any], int, int]
"""A sequence's K and V caches (ctx, kv heads, Dh), its position and its rows in a batch."""

_kernels: ModuleType | None
try:
    from foundry.model.kernels import _kernels  # type: ignore[attr-defined, no-redef]
except ImportError:  # built without a C compiler: the numpy fallback below
    _kernels = None

KERNELS: str = _kernels.isa() if _kernels is not None else "numpy"
"""The path products take here: "avx512-vnni+amx" (the K-quants' prefill block on AMX tiles),
"avx512-vnni", "avx2+vnni", "avx2", "neon", "neon-dotprod", "portable" (C) or "numpy" (no
extension)."""


class QuantError(ValueError):
    """A tensor that cannot be stored, cut or multiplied as asked (names the type and block)."""


def block_values(qtype: QType) -> int:
    """Values per block of a type (1 for F16 and F32)."""
    return TYPES[qtype].block_values


def row_bytes(qtype: QType, n: int) -> int:
    values, size = TYPES[qtype].block_values, TYPES[qtype].block_bytes
    if n % values:
        raise QuantError(f"a row of {n} values is not whole {qtype.name} blocks of {values}")
    return n // values * size


@dataclass(frozen=True, eq=False)
class QTensor:
    """A weight in its storage type: logical numpy shape ``shape`` (..., rows, cols) and the
    bytes of each row in ``data`` (..., rows, row_bytes), C-contiguous."""

    qtype: QType
    shape: tuple[int, ...]
    data: U8

    def __post_init__(self) -> None:
        if self.qtype not in SUPPORTED:
            raise QuantError(
                f"tensor type {self.qtype.name} is not supported; Foundry reads F32, "
                + ", ".join(t.name for t in SUPPORTED)
            )
        want = (*self.shape[:-1], row_bytes(self.qtype, self.shape[-1]))
        if self.data.dtype != np.uint8 or self.data.shape != want:
            raise QuantError(
                f"{self.qtype.name}{self.shape} needs uint8 bytes of shape {want}, got "
                f"{self.data.dtype}{self.data.shape}"
            )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def block(self) -> int:
        """Values per block along the last axis."""
        return block_values(self.qtype)

    def __getitem__(self, i: int) -> QTensor:
        """Index the first axis (one expert of a merged expert tensor): a view."""
        if self.ndim < 3:
            raise QuantError("QTensor indexing takes one expert of a 3-d expert tensor")
        return QTensor(self.qtype, self.shape[1:], self.data[i])

    def take(self, index: tuple[slice, ...]) -> QTensor:
        """The part ``index`` (one slice per axis, step 1) selects, as its own contiguous copy.

        A slice of the last axis must start and stop on block boundaries."""
        if len(index) != self.ndim:
            raise QuantError(f"index of {len(index)} axes for a {self.ndim}-d tensor")
        last = range(*index[-1].indices(self.shape[-1]))
        if index[-1].step not in (None, 1) or any(s.step not in (None, 1) for s in index):
            raise QuantError("QTensor slices take step 1 only")
        start, stop = (last.start, last.stop) if len(last) else (0, 0)
        if start % self.block or stop % self.block:
            raise QuantError(
                f"columns [{start}, {stop}) of a {self.qtype.name} tensor do not start and end on "
                f"its blocks of {self.block} values"
            )
        size = TYPES[self.qtype].block_bytes
        byte_slice = slice(start // self.block * size, stop // self.block * size)
        data = np.ascontiguousarray(self.data[(*index[:-1], byte_slice)])
        lead = zip(index[:-1], self.shape[:-1], strict=True)
        shape = (*(len(range(*s.indices(n))) for s, n in lead), len(last))
        return QTensor(self.qtype, shape, data)

    def dequantize(self) -> F32:
        """The float32 values (for checks and for the reference engine; never on the hot path)."""
        if self.data.size == 0:  # no values (a rank's slice of none: a rank without heads)
            return np.zeros(self.shape, np.float32)
        return _dequantize_rows(
            self.qtype, self.data.reshape(-1, self.data.shape[-1]), self.shape[-1]
        ).reshape(self.shape)

    def rows(self, ids: npt.NDArray[np.int64]) -> F32:
        """Rows ``ids`` of a 2-d tensor as float32 (the embedding lookup)."""
        if self.ndim != 2:
            raise QuantError("rows() reads a 2-d tensor")
        return _dequantize_rows(self.qtype, np.ascontiguousarray(self.data[ids]), self.shape[-1])


Param = F32 | QTensor
"""One parameter as the engine holds it: float32 numpy, or stored blocks."""


def storage_type(p: Param) -> QType:
    return p.qtype if isinstance(p, QTensor) else QType.F32


def from_stored(qtype: QType, view: npt.NDArray[Any]) -> Param:
    """A tensor as ``gguf.GGUFReader`` maps it (F32/F16: numpy of the logical shape; blocks:
    uint8 rows of bytes), without copying: F32 stays a numpy array."""
    if qtype == QType.F32:
        return view
    if qtype == QType.F16:
        return QTensor(qtype, tuple(view.shape), view.view(np.uint8))
    if qtype not in SUPPORTED:
        QTensor(qtype, (0,), np.empty((0,), np.uint8))  # raises the message naming the types
    shape = tuple(int(d) for d in gguf.quants.quant_shape_from_byte_shape(view.shape, qtype))
    return QTensor(qtype, shape, view)


def quantize(a: npt.NDArray[Any], qtype: QType) -> QTensor:
    """Store float values as ``qtype``: F16, the types the ``gguf`` package quantizes (Q8_0,
    Q4_0, Q4_1, Q5_0, Q5_1), and Q4_K and Q6_K (``kquants``: llama.cpp's reference
    quantizers, byte for byte)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if qtype == QType.F16:
        return QTensor(qtype, a.shape, a.astype(np.float16).view(np.uint8))
    if qtype in (QType.Q4_K, QType.Q6_K):
        from foundry.model.kernels import kquants

        write = kquants.quantize_q4_k if qtype == QType.Q4_K else kquants.quantize_q6_k
        try:
            return QTensor(qtype, a.shape, write(a))
        except ValueError as exc:
            raise QuantError(str(exc)) from None
    try:
        data = gguf.quants.quantize(a, qtype)
    except NotImplementedError:
        raise QuantError(f"the gguf package cannot quantize to {qtype.name}") from None
    return QTensor(qtype, a.shape, np.ascontiguousarray(data))


def dequantize(p: Param) -> F32:
    return p if isinstance(p, np.ndarray) else p.dequantize()


def _dequantize_rows(qtype: QType, data: U8, k: int) -> F32:
    """(rows, row_bytes) -> (rows, k) float32."""
    if _kernels is not None:
        out = np.empty((data.shape[0], k), np.float32)
        _kernels.dequantize(int(qtype), np.ascontiguousarray(data), data.shape[0], k, out)
        return out
    if qtype == QType.F16:
        return data.view(np.float16).astype(np.float32)
    return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)


def linear(x: F32, w: Param, out: F32 | None = None) -> F32:
    """x (N, in) @ w.T for w (out, in): numpy for float32, the block kernels otherwise; written
    to ``out`` (N, out) where given (the kernels write a C-contiguous one in place)."""
    if not isinstance(w, np.ndarray) and w.ndim != 2:
        raise QuantError(f"linear takes a 2-d weight, got {w.qtype.name}{w.shape}")
    if isinstance(w, np.ndarray) or _kernels is None:
        y = x @ dequantize(w).T  # (N, out)
    else:
        n_out, k = w.shape
        x = np.ascontiguousarray(x, dtype=np.float32)
        shape = (x.shape[0], n_out)
        y = out if out is not None and _c_f32(out, shape) else np.empty(shape, np.float32)
        _kernels.matmul(int(w.qtype), w.data, n_out, k, x, x.shape[0], y)
    if out is None or y is out:
        return y
    out[...] = y
    return out


def linear_groups(x: F32, groups: Sequence[tuple[int, int, Param]], out: F32) -> F32:
    """Rows lo .. hi - 1 of x (N, in) times each group's w (out, in) into the same rows of out
    (N, out): a prompt's experts, each on the rows of its assignments. Each group's rows get
    ``linear``'s bits; in the C module every group of stored blocks shares the same two pool
    calls (the inputs prepared, the rows' products), so the threads balance over all of them."""
    stored = [(lo, hi, w) for lo, hi, w in groups if isinstance(w, QTensor) and w.ndim == 2]
    if _kernels is None or len(stored) < len(groups) or len(groups) > 256 or out.ndim != 2:
        for lo, hi, w in groups:
            linear(x[lo:hi], w, out[lo:hi])
        return out
    x = np.ascontiguousarray(x, dtype=np.float32)
    calls = tuple((int(w.qtype), w.data, lo, hi) for lo, hi, w in stored)
    _kernels.matmul_groups(x, x.shape[0], x.shape[1], calls, out.shape[1], out)
    return out


def attend(q: F32, k: npt.NDArray[Any], v: npt.NDArray[Any], n_pos: int, out: F32) -> None:
    """One query row's attention, q (heads, Dh), against positions [0, n_pos) of a KV cache k, v
    (ctx, kv heads, Dh), written to out (heads, Dh): the decode step, in the C module with the
    products (one fixed order of operations; about 25 us a row of 100 positions on a Zen 3
    core with the cache warm, where numpy took 150), else ``layers.attention_forward``. q and
    out float32, the cache float32 or float16 (both k and v; its values converted exactly, the
    same operations after), all C-contiguous."""
    half = k.dtype == np.float16
    if (v.dtype == np.float16) != half or k.dtype not in (np.float16, np.float32):
        raise QuantError(f"attend takes a float32 or float16 cache, got {k.dtype} and {v.dtype}")
    if _kernels is None:
        kf, vf = (c[:n_pos].astype(np.float32) for c in (k, v))
        o, _ = attention_forward(q[None, None], kf[None], vf[None], offset=n_pos - 1)
        out[...] = o[0, 0]
        return
    _kernels.attend(q, k, v, int(half), n_pos, q.shape[0], k.shape[1], q.shape[1], out)


def attend_rows(
    q: F32, k: npt.NDArray[Any], v: npt.NDArray[Any], pos: int, window: int, out: F32
) -> None:
    """Rows q (n, heads, Dh) of one sequence at positions pos, pos + 1, ...: row t attends to
    positions [0, pos + t] of the cache k, v (ctx, kv heads, Dh), only the last ``window`` of
    them where window > 0; out (n, heads, Dh) written. Each row is ``attend``'s, bit for bit;
    in the C module all rows and kv heads at once on the kernels' threads."""
    n = q.shape[0]
    if _kernels is None:
        for t in range(n):
            n_pos = pos + t + 1
            first = max(0, n_pos - window) if window else 0
            attend(q[t], k[first:], v[first:], n_pos - first, out[t])
        return
    half = k.dtype == np.float16
    if (v.dtype == np.float16) != half or k.dtype not in (np.float16, np.float32):
        raise QuantError(f"attend takes a float32 or float16 cache, got {k.dtype} and {v.dtype}")
    _kernels.attend_rows(
        q, k, v, int(half), pos, window, n, q.shape[1], k.shape[1], q.shape[2], out
    )


def store_attend(
    q: F32, k_rows: F32, v_rows: F32, v_col: int, caches: Sequence[Cache], window: int, out: F32
) -> None:
    """One layer's attention for a batch of sequences, each (k, v, pos, rows) of ``caches``
    taking the next ``rows`` rows of q (n, heads, Dh): its K rows (k_rows's) and V rows
    (columns v_col .. of v_rows's) into its caches at pos, pos + 1, ... as :func:`store_rows`
    writes them, then each row's attention as :func:`attend_rows` computes it (the same bits);
    in the C module one call, every row's kv heads the tasks of one pool call."""
    if _kernels is None:
        row = 0
        for k, v, pos, n in caches:
            store_rows(k_rows[row : row + n], 0, k[pos : pos + n])
            store_rows(v_rows[row : row + n], v_col, v[pos : pos + n])
            attend_rows(q[row : row + n], k, v, pos, window, out[row : row + n])
            row += n
        return
    ld, (heads, dh) = k_rows.shape[1], q.shape[1:]
    args = (v_rows, v_col, v_rows.shape[1], caches, window, heads, ld // dh, dh, out)
    _kernels.store_attend(q, k_rows, 0, ld, *args)


def set_threads(n: int) -> None:
    """Run the kernels on ``n`` threads (this one included) from now on, process-wide: the
    products split by rows, attention by heads, a block's other operations by rows. The
    results are the same bits at any ``n``
    (csrc/pool.c says why). Without the C module, nothing to do."""
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    if _kernels is not None:
        _kernels.set_threads(n)


def threads() -> int:
    """The threads the kernels run on (1 without the C module)."""
    return int(_kernels.threads()) if _kernels is not None else 1


def profile(on: bool) -> dict[str, tuple[int, int]]:
    """Where the one-token step's time went since the last call: {phase: (nanoseconds,
    calls)} (csrc/kernels.h, PROF_*), the counters reset, counting on from now if ``on``.
    For benchmarks (bench/performance/engine.py --profile): two clock reads a phase."""
    if _kernels is None:
        return {}
    return {k: (int(v[0]), int(v[1])) for k, v in _kernels.profile(on).items()}


# The rest of a decode step in the C module, each row in one fixed order of operations (the
# products' rule: a row's bits depend neither on the other rows nor on the path or machine);
# without the module, the training layers' numpy. Arguments float32 (top int64), C-contiguous.
# A block of rows (a prompt's) is cut into tasks of whole rows on the kernels' threads
# (csrc/decode.c, ``on_rows``): the same bits at any thread count.


def rmsnorm(x: F32, w: F32, eps: float) -> F32:
    """x (N, D) / rms(x) * w (D,)."""
    if _kernels is None:
        return rmsnorm_forward(x, w, eps)[0]
    out = np.empty_like(x)
    _kernels.rmsnorm(x, w, x.shape[0], x.shape[1], eps, out)
    return out


def rope(x: F32, cos: F32, sin: F32, neox: bool = False) -> F32:
    """x (N, heads, Dh) turned pair by pair by cos, sin (N, Dh/2): a new array. The pairs are
    adjacent, (2i, 2i + 1), or with ``neox`` (i, i + Dh/2), the same operations on each."""
    if _kernels is None:
        if not neox:
            return rope_forward(x, cos, sin)
        n, heads, dh = x.shape  # the adjacent rotation of the interleaved copy
        inter = x.reshape(n, heads, 2, dh // 2).transpose(0, 1, 3, 2).reshape(n, heads, dh)
        y = rope_forward(np.ascontiguousarray(inter), cos, sin)
        return np.ascontiguousarray(
            y.reshape(n, heads, dh // 2, 2).transpose(0, 1, 3, 2).reshape(n, heads, dh)
        )
    x = np.ascontiguousarray(x)  # a block's Q and K columns are a strided view of its product
    out = np.empty_like(x)
    _kernels.rope(x, cos, sin, x.shape[0], x.shape[1], x.shape[2], int(neox), out)
    return out


def swiglu(gu: F32) -> F32:
    """silu(g) * u of each row [g | u] of gu (N, 2F): (N, F)."""
    f = gu.shape[1] // 2
    if _kernels is None:
        return silu_and_sigmoid(gu[:, :f])[0] * gu[:, f:]
    out = np.empty((gu.shape[0], f), np.float32)
    _kernels.swiglu(gu, gu.shape[0], f, out)
    return out


def geglu(gu: F32) -> F32:
    """gelu(g) * u of each row [g | u] of gu (N, 2F): (N, F), bit for bit ``nn.layers.geglu``."""
    if _kernels is None:
        return numpy_geglu(gu)
    f = gu.shape[1] // 2
    out = np.empty((gu.shape[0], f), np.float32)
    _kernels.geglu(np.ascontiguousarray(gu, np.float32), gelu_table(), gu.shape[0], f, out)
    return out


def route(x: F32, w_router: F32, k: int) -> tuple[F32, I64]:
    """Each row's gating weights (N, K) and expert ids (N, K), as ``router_forward(rowwise)``."""
    if _kernels is None:
        weights, top, _ = router_forward(x, w_router, k, rowwise=True)
        return weights, top
    n = x.shape[0]
    weights = np.empty((n, k), np.float32)
    top = np.empty((n, k), np.int64)
    _kernels.route(x, w_router, n, x.shape[1], w_router.shape[0], k, weights, top)
    return weights, top


def assign_experts(top: I64, first_expert: int, n_local: int) -> tuple[I64, I64]:
    """``expert_assignments``: order (M,) grouped by local expert, bounds (n_local + 1,)."""
    if _kernels is None:
        return expert_assignments(top, first_expert, n_local)
    order = np.empty(top.size, np.int64)
    bounds = np.empty(n_local + 1, np.int64)
    m = _kernels.assign(np.ascontiguousarray(top, np.int64), first_expert, n_local, order, bounds)
    return order[:m], bounds


def combine_experts(ys: F32, weights: F32, order: I64) -> F32:
    """``combine_expert_outputs``: each row's weighted sum of its assignments' outputs (N, D)."""
    if _kernels is None:
        return combine_expert_outputs(ys, weights, order)
    n, k = weights.shape
    out = np.empty((n, ys.shape[1]), np.float32)
    _kernels.combine(ys, weights, np.ascontiguousarray(order), n, k, ys.shape[1], out)
    return out


def add(a: F32, b: F32, out: F32 | None = None) -> F32:
    """a + b of two (N, D) float32 arrays, written to ``out`` where given (it may be ``a``: the
    residual's x += y); in the C module a block's rows on the kernels' threads."""
    arrays = (a, b) if out is None else (a, b, out)
    if _kernels is None or a.ndim != 2 or not all(_c_f32(t, a.shape) for t in arrays):
        return np.add(a, b, out=out)
    out = np.empty_like(a) if out is None else out
    _kernels.add(a, b, a.shape[0], a.shape[1], out)
    return out


def store_rows(y: F32, col: int, cache: npt.NDArray[Any]) -> None:
    """Columns col .. col + d - 1 of the rows y (N, width) into cache (N, kv heads, Dh), d its
    heads' values: a block's K or V rows into its cache rows, float16 (rounded as numpy's
    astype, to nearest even) or float32; in the C module on the kernels' threads."""
    n, d = cache.shape[0], int(np.prod(cache.shape[1:]))
    if _kernels is None or not _c_f32(y, (n, y.shape[-1])) or not cache.flags.c_contiguous:
        cache[...] = y[:, col : col + d].reshape(cache.shape)
        return
    _kernels.store_rows(y, col, y.shape[1], n, d, int(cache.dtype == np.float16), cache)


def take_rows(x: F32, idx: I64) -> F32:
    """Rows ``idx`` of x (N, D): (M, D), as ``x[idx]``; in the C module on the kernels' threads."""
    if _kernels is None or not _c_f32(x, x.shape) or x.ndim != 2:
        return x[idx]
    out = np.empty((idx.shape[0], x.shape[1]), np.float32)
    _kernels.take_rows(x, x.shape[0], np.ascontiguousarray(idx, np.int64), x.shape[1], out)
    return out


def _c_f32(a: npt.NDArray[Any], shape: tuple[int, ...]) -> bool:
    return a.dtype == np.float32 and a.shape == shape and bool(a.flags.c_contiguous)


def embed(w: Param, ids: npt.NDArray[np.int64]) -> F32:
    """Rows ``ids`` of the embedding table (N, D), float32 whatever the storage."""
    return w[ids] if isinstance(w, np.ndarray) else w.rows(ids)


# The one-token step of a layer in one call (``csrc/step.c``): inference.Engine describes each
# layer once (``step_plan``, addresses of weights the engine keeps alive) and runs a token's
# layer, or one part's gate, through the same C routines as the operations above, in their
# order, so the bits are theirs. Without the C module there is no plan: the engine's path of
# single operations runs instead.


def has_step() -> bool:
    """Whether ``step_plan`` can describe layers here (the C module is built and in use)."""
    return _kernels is not None


StepPlan = Any
"""An opaque plan of one layer (a capsule of the C module)."""

Address = NewType("Address", int)
"""The address of bytes the caller keeps alive (0: none), a C ``unsigned long long``."""


class StepMat(NamedTuple):
    """A matrix of stored blocks as ``step_plan`` reads it (py_step.c ``parse_mat``)."""

    type: int
    address: Address
    rows: int
    k: int


StepExpert = tuple[tuple[StepMat, ...], StepMat]
"""One routed expert in a part's plan: its gate and up matrices (stacked, or one each), down."""


class StepPart(NamedTuple):
    """One part's attention and dense FFN, or routed experts, in a layer's plan (py_step.c
    ``parse_part``).

    ``down`` is None where the part has no dense FFN (``gate_up`` empty); ``n_ff`` is then 0.
    ``out`` is None, ``qkv`` empty and the heads' counts 0 for a part without heads (a rank
    beyond the kv heads' groups, ``shard.slices.kv_group_for``): its attention partial is zero.
    ``experts`` (the part's routed experts, the first of them expert ``first_exp``) is read
    where the layer has a router (``StepLayer.router``), and is empty otherwise.
    """

    qkv: tuple[StepMat, ...]
    out: StepMat | None
    gate_up: tuple[StepMat, ...]
    down: StepMat | None
    n_q: int
    n_k: int
    n_v: int
    n_kv: int
    n_ff: int
    q_keep_first: int
    q_keep_end: int
    k_keep_first: int
    k_keep_end: int
    skip_kv: int
    bias_q: Address
    bias_k: Address
    bias_v: Address
    q_norm: Address
    k_norm: Address
    first_exp: int
    experts: tuple[StepExpert, ...]


class StepLayer(NamedTuple):
    """A layer's one-token step as ``step_plan`` reads it (py_step.c ``py_step_plan``); being a
    tuple, it is what crosses into C, field by field in this order."""

    d: int
    dh: int
    half: int
    neox: int
    qk_norm: int
    window: int
    gelu: int
    eps: float
    attn_norm: Address
    ffn_norm: Address
    post_attn: Address
    post_ffn: Address
    gelu_table: Address
    router: Address  # routed experts in the step: the router (n_expert, d) float32, else 0
    n_expert: int
    n_used: int
    parts: tuple[StepPart, ...]


def step_mat(w: QTensor) -> StepMat:
    """A 2-d QTensor as ``step_plan`` reads it (its bytes must stay alive and C-contiguous)."""
    if w.ndim != 2 or not w.data.flags.c_contiguous:
        raise QuantError(f"a step takes C-contiguous 2-d blocks, got {w.qtype.name}{w.shape}")
    return StepMat(int(w.qtype), Address(int(w.data.ctypes.data)), w.shape[0], w.shape[1])


def address(a: F32 | None) -> Address:
    """The address of a C-contiguous float32 vector (0 for None) that the caller keeps alive."""
    if a is None:
        return Address(0)
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise QuantError(f"a step reads C-contiguous float32 vectors, got {a.dtype}")
    return Address(int(a.ctypes.data))


def step_plan(layer: StepLayer) -> StepPlan:
    """A layer's plan (``_kernels.step_plan`` reads ``layer`` as the tuple it is)."""
    assert _kernels is not None
    return _kernels.step_plan(layer)


def step_layer(
    plan: StepPlan,
    x: F32,
    pos: int,
    k: tuple[npt.NDArray[Any], ...],
    v: tuple[npt.NDArray[Any], ...],
    cos: F32,
    sin: F32,
) -> None:
    """x (1, D) += the layer at position pos, every part in turn (their caches k, v)."""
    assert _kernels is not None
    _kernels.step_layer(plan, x, pos, k, v, cos, sin)


def step_layers(
    plans: tuple[StepPlan, ...],
    x: F32,
    pos: int,
    k: Sequence[Sequence[npt.NDArray[Any]]],
    v: Sequence[Sequence[npt.NDArray[Any]]],
    tables: tuple[tuple[F32, F32], ...],
    gate: tuple[Callable[[int, int], None], F32] | tuple[object] | None = None,
) -> None:
    """``step_layer`` of each plan in turn (layer i: caches k[i], v[i], rope tables[i]), in
    one call. ``gate``, for a rank of a world: (hook, buffer of shape (1, D)); at each gate the
    rank's partial is put in the buffer and ``hook(layer, gate)`` replaces it in place with the
    world's total (an exception it raises ends the call). Or (capsule,): a transport's gates in
    C (``GateExchange.step_gates``), a failed one raising ConnectionError."""
    assert _kernels is not None
    if gate is None:
        _kernels.step_layers(plans, x, pos, k, v, tables)
    else:
        _kernels.step_layers(plans, x, pos, k, v, tables, *gate)


def step_attn(
    plan: StepPlan,
    j: int,
    h: F32,
    pos: int,
    k: npt.NDArray[Any],
    v: npt.NDArray[Any],
    cos: F32,
    sin: F32,
) -> F32:
    """Part j's ATTN partial (1, D) of the normed row h (1, D) at position pos."""
    assert _kernels is not None
    out = np.empty_like(h)
    _kernels.step_attn(plan, j, h, pos, k, v, cos, sin, out)
    return out


def step_ffn(plan: StepPlan, j: int, h: F32) -> F32:
    """Part j's dense FFN partial (1, D) of the normed row h (1, D)."""
    assert _kernels is not None
    out = np.empty_like(h)
    _kernels.step_ffn(plan, j, h, out)
    return out
