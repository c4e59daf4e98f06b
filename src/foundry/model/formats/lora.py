"""LoRA adapters of a published model: their shapes, their start, the merge, and the adapter
GGUF file llama.cpp's ``--lora`` loads.

LoRA (Hu et al., arXiv 2106.09685) leaves a projection W (out, in) frozen and learns a low-rank
change beside it:

    y = x W^T + (alpha / r) (x A^T) B^T          A (r, in), B (out, r)

A starts as PEFT starts it (Kaiming-uniform, bound 1 / sqrt(in)) and B at zero, so the model
before the first step is the base model exactly. The names users know are PEFT's: ``r``
(``--lora-rank``), ``lora_alpha`` (``--lora-alpha``, default 8 as PEFT's), ``lora_dropout``
(``--lora-dropout``, default 0) and ``target_modules`` (``--lora-targets``, which names the
GGUF projections: ``attn_q``, ``attn_k``, ``attn_v``, ``attn_output``, ``ffn_gate``, ``ffn_up``,
``ffn_down``; default ``attn_q,attn_v``, PEFT's ``q_proj, v_proj`` for llama-like models).

Adapter tensors are named as llama.cpp's adapter files name them: ``blk.N.attn_q.weight.lora_a``
(numpy (r, in), ggml ne [in, r]) and ``blk.N.attn_q.weight.lora_b`` (numpy (out, r)). The file
(:func:`save_adapter`) holds ``general.type = "adapter"``, ``adapter.type = "lora"``,
``adapter.lora.alpha`` (f32) and the base's ``general.architecture``; llama.cpp scales each
pair by alpha / r, r read from the tensors. A merged model (:func:`merge`) is the base with
W + (alpha / r) B A in place of W.

The routed experts of a Mixture-of-Experts file (qwen3moe, olmoe) stay frozen: the targets are
the dense projections, and ``ffn_*`` targets are refused for a model whose FFN is experts.
Nothing here imports torch: the inference side reads adapters with numpy alone.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from foundry.model.formats import gguf_meta
from foundry.model.kernels.quant import Param, dequantize
from foundry.model.spec.arch import ArchConfig
from foundry.model.spec.config import ModelConfig

F32 = npt.NDArray[np.float32]

TARGETS: tuple[str, ...] = (
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)
"""The projections an adapter may sit beside, by their GGUF names."""
DEFAULT_TARGETS: tuple[str, ...] = ("attn_q", "attn_v")  # PEFT's q_proj, v_proj
DEFAULT_RANK = 8  # PEFT's r
DEFAULT_ALPHA = 8.0  # PEFT's lora_alpha
SUFFIX_A, SUFFIX_B = ".lora_a", ".lora_b"
# Largest rank accepted: far above what fine-tuning uses (4-64), small enough that a typo is
# caught before it sizes anything.
MAX_RANK = 4096


class LoraError(ValueError):
    """Adapter settings or an adapter file that do not fit the model; says what to change."""


@dataclass(frozen=True)
class LoraSpec:
    """PEFT's LoraConfig in GGUF terms: rank, alpha, dropout and the target projections."""

    rank: int = DEFAULT_RANK
    alpha: float = DEFAULT_ALPHA
    targets: tuple[str, ...] = DEFAULT_TARGETS
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_RANK:
            raise LoraError(f"--lora-rank must lie in [1, {MAX_RANK}], got {self.rank}")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise LoraError(f"--lora-alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"--lora-dropout must lie in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise LoraError(
                f"--lora-targets {','.join(self.targets)!r}: name each once, from "
                f"{', '.join(TARGETS)}"
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def parse_targets(text: str) -> tuple[str, ...]:
    """``attn_q,attn_v`` -> ("attn_q", "attn_v"); ``all`` is every target."""
    if text.strip() == "all":
        return TARGETS
    return tuple(t.strip() for t in text.split(",") if t.strip())


def adapter_names(base: str) -> tuple[str, str]:
    """The two adapter tensors of base tensor ``base`` (``blk.0.attn_q.weight``)."""
    return base + SUFFIX_A, base + SUFFIX_B


def base_of(name: str) -> str:
    """The base tensor an adapter tensor belongs to."""
    for suffix in (SUFFIX_A, SUFFIX_B):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    raise LoraError(f"tensor {name!r} is not a LoRA tensor (.lora_a or .lora_b)")


def target_tensors(cfg: ModelConfig, targets: Sequence[str]) -> list[str]:
    """The base tensors the targets name, layer by layer (a model whose FFN is routed experts
    has no ``ffn_gate``/``ffn_up``/``ffn_down`` to adapt: refused)."""
    shapes = cfg.param_shapes()
    out: list[str] = []
    for i in range(cfg.n_layer):
        for t in targets:
            name = f"blk.{i}.{t}.weight"
            if name not in shapes:
                arch = cfg.architecture if isinstance(cfg, ArchConfig) else "llama"
                raise LoraError(
                    f"{arch} has no {t} (its FFN is routed experts, which stay frozen); "
                    f"choose --lora-targets among the attention projections"
                )
            out.append(name)
    return out


def adapter_shapes(cfg: ModelConfig, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """Every adapter tensor's numpy shape, in layer order, A before B."""
    shapes = cfg.param_shapes()
    out: dict[str, tuple[int, int]] = {}
    for name in target_tensors(cfg, spec.targets):
        n_out, n_in = shapes[name]
        a, b = adapter_names(name)
        out[a] = (spec.rank, n_in)
        out[b] = (n_out, spec.rank)
    return out


def init_adapters(cfg: ModelConfig, spec: LoraSpec, seed: int = 0) -> dict[str, F32]:
    """A from PEFT's init (``kaiming_uniform_(a=sqrt(5))``: uniform in +-1/sqrt(in)), B zero."""
    rng = np.random.default_rng(seed)
    out: dict[str, F32] = {}
    for name, shape in adapter_shapes(cfg, spec).items():
        if name.endswith(SUFFIX_A):
            bound = 1.0 / math.sqrt(shape[1])
            out[name] = rng.uniform(-bound, bound, shape).astype(np.float32)
        else:
            out[name] = np.zeros(shape, np.float32)
    return out


def delta(adapters: Mapping[str, F32], base: str, scale: float) -> F32:
    """(alpha / r) B A of one base tensor, (out, in) float32 (products in float64)."""
    a, b = (adapters[n] for n in adapter_names(base))
    return (scale * (b.astype(np.float64) @ a.astype(np.float64))).astype(np.float32)


def merge(
    params: Mapping[str, Param], adapters: Mapping[str, F32], scale: float
) -> dict[str, Param]:
    """The base with W + scale B A for every adapted tensor (float32); others as they are."""
    bases = sorted({base_of(n) for n in adapters})
    out = dict(params)
    for base in bases:
        if base not in params:
            raise LoraError(f"the adapter adapts {base!r}, which the model does not have")
        w = dequantize(params[base])
        d = delta(adapters, base, scale)
        if d.shape != w.shape:
            raise LoraError(
                f"the adapter of {base!r} is {d.shape}, the model's tensor "
                f"{w.shape}: it was trained on another model"
            )
        out[base] = (w.astype(np.float32) + d).astype(np.float32)
    return out


# -- the adapter file ------------------------------------------------------------------------


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter file's content: the architecture it is for, alpha, the tensors."""

    architecture: str
    alpha: float
    tensors: dict[str, F32]
    base_name: str = ""  # general.name of the base file (informative)

    @property
    def rank(self) -> int:
        return int(next(t.shape[0] for n, t in self.tensors.items() if n.endswith(SUFFIX_A)))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def save_adapter(
    path: str | Path,
    architecture: str,
    alpha: float,
    tensors: Mapping[str, F32],
    base_name: str = "",
) -> None:
    """Write the adapter GGUF llama.cpp's ``--lora`` loads (atomically: temp file + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, architecture)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(alpha))
    w.add_name(f"{base_name or architecture} LoRA")
    for name, t in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        assert w.fout is not None
        for f in w.fout:
            f.flush()
            os.fsync(f.fileno())
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise


def load_adapter(path: str | Path) -> Adapter:
    """Read an adapter file (F32 or F16 tensors), checked: names in pairs, ranks agree."""
    import mmap

    path = Path(path)
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            layout = gguf_meta.read_layout(buf, path)
            meta = layout.metadata
            if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
                raise LoraError(
                    f"{path} is not a LoRA adapter (general.type "
                    f"{meta.get('general.type')!r}, adapter.type {meta.get('adapter.type')!r});"
                    " pass the adapter file `foundry train --base-model ... --lora-rank` wrote"
                )
            tensors = {t.name: _read_tensor(buf, t, path) for t in layout.tensors}
    except OSError as exc:
        raise LoraError(f"cannot read adapter {path}: {exc}") from None
    except gguf_meta.GGUFMetaError as exc:
        raise LoraError(str(exc)) from None
    alpha = meta.get("adapter.lora.alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise LoraError(f"{path}: adapter.lora.alpha is {alpha!r}, expected a positive number")
    if not tensors:
        raise LoraError(f"{path} holds no adapter tensors")
    ranks = set()
    for name, t in tensors.items():
        base = base_of(name)
        a, b = adapter_names(base)
        if a not in tensors or b not in tensors:
            raise LoraError(f"{path}: {base!r} lacks its .lora_a or .lora_b")
        if t.ndim != 2:
            raise LoraError(f"{path}: {name!r} is not a matrix")
        ranks.add(tensors[a].shape[0])
        if tensors[b].shape[1] != tensors[a].shape[0]:
            raise LoraError(f"{path}: {base!r}'s lora_a and lora_b disagree on the rank")
    if len(ranks) != 1:
        raise LoraError(f"{path}: the adapters have ranks {sorted(ranks)}; Foundry reads one")
    return Adapter(
        str(meta.get("general.architecture", "")),
        float(alpha),
        tensors,
        str(meta.get("general.name", "")),
    )


def _read_tensor(buf: Any, t: gguf_meta.TensorInfo, path: Path) -> F32:
    shape = tuple(reversed(t.dims))
    n = math.prod(shape)
    kinds = {
        int(gguf.GGMLQuantizationType.F32): np.float32,
        int(gguf.GGMLQuantizationType.F16): np.float16,
    }
    dtype = kinds.get(t.ggml_type)
    if dtype is None:
        raise LoraError(
            f"{path}: adapter tensor {t.name!r} has ggml type {t.ggml_type}; "
            "Foundry reads F32 and F16 adapters"
        )
    at = t.offset
    size = n * np.dtype(dtype).itemsize
    if at + size > len(buf):
        raise LoraError(f"{path}: tensor {t.name!r} ends past the end of the file")
    return np.frombuffer(buf, dtype, n, at).astype(np.float32).reshape(shape)


def apply_adapter(
    cfg: ModelConfig, params: Mapping[str, Param], adapter: Adapter, source: str
) -> dict[str, Param]:
    """The model's tensors with the adapter merged in, for serving ``--lora FILE`` (the
    adapted tensors become float32; the rest are held as they are). The adapter must be for
    this architecture and these shapes."""
    check_architecture(cfg, adapter, source)
    return merge(params, adapter.tensors, adapter.scale)


def check_architecture(cfg: ModelConfig, adapter: Adapter, source: str) -> None:
    """LoraError unless ``adapter`` was trained on a model of ``cfg``'s architecture and its
    tensors fit ``cfg``'s."""
    arch = cfg.architecture if isinstance(cfg, ArchConfig) else "llama"
    if adapter.architecture != arch:
        raise LoraError(
            f"{source} is an adapter for {adapter.architecture!r}, the model is {arch!r}"
        )
    shapes = cfg.param_shapes()
    for name in adapter.tensors:
        base = base_of(name)
        if base not in shapes:
            raise LoraError(f"{source} adapts {base!r}, which the model does not have")
        a, b = (adapter.tensors[n] for n in adapter_names(base))
        if (b.shape[0], a.shape[1]) != shapes[base]:
            raise LoraError(
                f"{source}'s adapter of {base!r} is ({b.shape[0]}, {a.shape[1]}), "
                f"the model's tensor {shapes[base]}: it was trained on another model"
            )
