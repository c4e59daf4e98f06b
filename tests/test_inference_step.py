"""The one-token step in C (``csrc/step.c``, ``Engine.step_in_c``) against the engine's single
operations, bit for bit, on the tiny published-architecture files with their matrices stored
as blocks (the step runs only on stored blocks; float32 matrices keep numpy's products).

Each layer gets a mix of types: even layers one type for Q, K and V and for gate and up (the
stacked products), odd layers a different type for each (one product each), so both shapes of
the plan run. A prompt goes through the block path (several rows: the single operations), then
one token at a time past the sliding window (gemma3's is 5) through the step, and every logit's
bits are compared; the same with one operation of the single path moved slightly must differ,
so the comparison reads real bits."""

from __future__ import annotations

import re
import typing
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from published import TINY, prompts, write_tiny

from foundry.model.formats.gguf_io import load_gguf_stored, save_gguf
from foundry.model.infer import inference, parts
from foundry.model.infer.inference import Engine, Gate
from foundry.model.infer.kv_cache import KVCache, Session
from foundry.model.kernels import quant
from foundry.model.kernels.quant import Param, QTensor, QType, dequantize, quantize
from foundry.model.nn.transformer import init_params
from foundry.model.shard.slices import rank_weights
from foundry.model.shard.table import ExpertSplit
from foundry.model.spec.config import ModelConfig

F32 = npt.NDArray[np.float32]
STEPS = 10  # one-token steps after the prompt (past gemma3's window of 5)
EVEN = {
    "q": QType.Q8_0,
    "k": QType.Q8_0,
    "v": QType.Q8_0,
    "output": QType.Q5_0,
    "gate": QType.Q4_0,
    "up": QType.Q4_0,
    "down": QType.Q8_0,
}
ODD = {
    "q": QType.Q4_0,
    "k": QType.Q5_0,
    "v": QType.F16,
    "output": QType.Q4_1,
    "gate": QType.Q8_0,
    "up": QType.Q5_1,
    "down": QType.Q4_0,
}


def stored(path: Path) -> tuple[Any, dict[str, Param]]:
    """The file's model with every attention and dense FFN matrix stored as blocks (the type
    by layer parity) and the head and embeddings as Q8_0; experts stay float32."""
    m = load_gguf_stored(path)
    params = dict(m.params)
    for name, p in m.params.items():
        parts = name.split(".")
        if parts[0] == "blk" and parts[-1] == "weight" and len(p.shape) == 2:
            kind = parts[2].removeprefix("attn_").removeprefix("ffn_")
            types = EVEN if int(parts[1]) % 2 == 0 else ODD
            if kind in types:
                params[name] = quantize(dequantize(p), types[kind])
        elif name in ("token_embd.weight", "output.weight"):
            params[name] = quantize(dequantize(p), QType.Q8_0)
    return m.cfg, params


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, dict[str, Param]]]:
    folder = tmp_path_factory.mktemp("step")
    out = {}
    for name in TINY:
        write_tiny(folder / f"{name}.gguf", name)
        out[name] = stored(folder / f"{name}.gguf")
    return out


def run(engine: Engine, name: str, in_c: bool) -> list[F32]:
    """The prompt's logits, then STEPS greedy tokens' one at a time."""
    engine.step_in_c = in_c
    session = engine.new_session()
    out = [engine.decode(session, prompts(name)[0])]
    for _ in range(STEPS):
        out.append(engine.decode(session, [int(np.argmax(out[-1][-1]))]))
    return out


def same_bits(a: list[F32], b: list[F32]) -> bool:
    return len(a) == len(b) and all(x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("cache", [KVCache.F16, KVCache.F32])
@pytest.mark.parametrize("name", list(TINY))
def test_the_step_in_c_equals_the_single_operations(
    models: dict[str, tuple[Any, dict[str, Param]]], name: str, cache: KVCache
) -> None:
    cfg, params = models[name]
    engine = Engine(cfg, params, kv_cache=cache)
    assert engine.layers_in_c == cfg.n_layer and engine.step_in_c
    assert isinstance(engine.parts[0].params["blk.0.attn_q.weight"], QTensor)
    ref = run(engine, name, False)
    got = run(engine, name, True)
    assert same_bits(got, ref)
    assert len({int(np.argmax(x[-1])) for x in ref}) > 1  # the steps do vary


def nudge(fn: Callable[..., Any], calls: list[int]) -> Callable[..., Any]:
    """``fn`` whose output moves by a factor 1 + 2^-8 on the call numbered calls[0] (an
    operation of the first one-token step's first layer); smaller moves may vanish in the
    rounding of the next product's int8 input."""

    def moved(*args: Any) -> Any:
        out = fn(*args)
        calls[1] += 1
        if calls[1] == calls[0]:
            target = args[-1] if out is None else out  # store_attend writes its last argument
            target *= np.float32(1 + 2**-8)
        return out

    return moved


@pytest.mark.parametrize(
    ("module", "op"),
    [
        (inference, "rmsnorm"),
        (inference, "rope"),
        (inference, "store_attend"),
        (inference, "linear"),
        (parts, "geglu"),  # the dense FFN's, in the parts' arithmetic
    ],
)
def test_a_moved_operation_is_seen(
    models: dict[str, tuple[Any, dict[str, Param]]],
    module: ModuleType,
    op: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg, params = models["gemma3"]
    engine = Engine(cfg, params)
    ref = run(engine, "gemma3", True)
    engine = Engine(cfg, params)
    engine.step_in_c = False
    session = engine.new_session()
    first = [engine.decode(session, prompts("gemma3")[0])]
    # the prompt ran unchanged; now one value of one call of the next (one-row) pass moves
    monkeypatch.setattr(module, op, nudge(getattr(module, op), [1, 0]))
    out = [*first, engine.decode(session, [int(np.argmax(first[-1][-1]))])]
    for _ in range(STEPS - 1):
        out.append(engine.decode(session, [int(np.argmax(out[-1][-1]))]))
    assert same_bits(out[:1], ref[:1])
    assert not same_bits(out, ref)


class _Exchange:
    """Two ranks' partials added p0 + p1 (the pair's gate), across two threads."""

    def __init__(self) -> None:
        import threading

        self.barrier = threading.Barrier(2)
        self.slots: list[F32 | None] = [None, None]

    def for_rank(self, rank: int) -> Callable[[int, Gate, F32], F32]:
        def exchange(layer: int, gate: Gate, partial: F32) -> F32:
            self.slots[rank] = partial.copy()
            self.barrier.wait(timeout=60)
            total = self.slots[0] + self.slots[1]  # type: ignore[operator]
            self.barrier.wait(timeout=60)
            return total

        return exchange


@pytest.mark.parametrize("name", ["gemma3", "qwen3", "olmoe", "qwen2"])
def test_the_pair_equals_one_process_with_the_step(
    models: dict[str, tuple[Any, dict[str, Param]]], name: str
) -> None:
    """Each rank runs its slice's layers in one step call, each gate's partial exchanged
    through the call's hook; one process runs whole layers: the same bits."""
    cfg, params = models[name]
    single = Engine(cfg, params)
    assert len(single.parts) == 2 and single.layers_in_c == cfg.n_layer
    ranks = [Engine(cfg, rank_weights(cfg, params, r, 2), rank=r, world=2) for r in range(2)]
    assert all(e.layers_in_c == cfg.n_layer for e in ranks)
    ex = _Exchange()
    s_one = single.new_session()
    s_pair: list[Session] = [e.new_session() for e in ranks]
    with ThreadPoolExecutor(1) as pool:

        def pair(tokens: list[int]) -> F32:
            job = pool.submit(ranks[1].decode, s_pair[1], tokens, ex.for_rank(1))
            half0 = ranks[0].decode(s_pair[0], tokens, ex.for_rank(0))
            return np.concatenate([half0, job.result(timeout=60)], axis=1)

        ref, got = single.decode(s_one, prompts(name)[1]), pair(prompts(name)[1])
        assert ref.tobytes() == got.tobytes()
        for _ in range(STEPS):
            token = int(np.argmax(ref[-1]))
            ref, got = single.decode(s_one, [token]), pair([token])
            assert ref.tobytes() == got.tobytes()


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_an_exchange_that_fails_inside_the_step_leaves_the_session_as_it_was(
    models: dict[str, tuple[Any, dict[str, Param]]], name: str
) -> None:
    """The one-call step's hook raises what the exchange raised (here at layer 1's FFN gate);
    the session's position is unchanged, and the next step (an exchange that gives the totals
    back) equals one process that never failed, bit for bit."""
    cfg, params = models[name]
    ref, engine = Engine(cfg, params), Engine(cfg, params)
    assert engine.layers_in_c == cfg.n_layer
    s_ref, s = ref.new_session(), engine.new_session()
    ref.decode(s_ref, prompts(name)[1])
    engine.decode(s, prompts(name)[1])
    seen: list[tuple[int, Gate]] = []

    def failing(layer: int, gate: Gate, total: F32) -> F32:
        seen.append((layer, gate))
        if (layer, gate) == (1, Gate.FFN):
            raise ConnectionError("the peer is gone")
        return total

    with pytest.raises(ConnectionError, match="the peer is gone"):
        engine.decode(s, [5], failing)
    assert seen == [(0, Gate.ATTN), (0, Gate.FFN), (1, Gate.ATTN), (1, Gate.FFN)]
    assert s.pos == s_ref.pos
    for token in (5, 7):
        want = ref.decode(s_ref, [token])
        got = engine.decode(s, [token], lambda layer, gate, total: total)
        assert want.tobytes() == got.tobytes()


@pytest.mark.parametrize("name", ["gemma3", "qwen2"])
def test_layers_in_c_among_float32_layers(
    models: dict[str, tuple[Any, dict[str, Param]]], name: str, tmp_path: Path
) -> None:
    """Layer 0 stored as blocks, the others float32 (numpy's products): layer 0 alone runs in
    C, one call of its own, the rest as single operations; the same bits as all single."""
    cfg, params = models[name]
    write_tiny(tmp_path / "f.gguf", name)
    plain = load_gguf_stored(tmp_path / "f.gguf").params
    mixed = {n: p if n.startswith("blk.0.") else plain[n] for n, p in params.items()}
    engine = Engine(cfg, mixed, kv_cache=KVCache.F16)
    assert engine.layers_in_c == 1 and engine._plans[0] is not None
    assert same_bits(run(engine, name, True), run(engine, name, False))


def test_without_the_c_module_the_numpy_fallback_decodes(
    models: dict[str, tuple[Any, dict[str, Param]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No C module: no step, the single operations' numpy fallback (dequantized products),
    close to the kernels' logits (they quantize each input to int8)."""
    cfg, params = models["gemma3"]
    want = run(Engine(cfg, params), "gemma3", True)
    monkeypatch.setattr(quant, "_kernels", None)
    engine = Engine(cfg, params)
    assert engine.layers_in_c == 0 and not engine.step_in_c
    session = engine.new_session()
    got = [engine.decode(session, prompts("gemma3")[0])]
    for step in range(1, STEPS + 1):  # the kernels' tokens, so both see the same history
        got.append(engine.decode(session, [int(np.argmax(want[step - 1][-1]))]))
    for a, b in zip(got, want, strict=True):
        assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.99


def test_float32_matrices_keep_the_single_operations(tmp_path: Path) -> None:
    """numpy's float32 products are not the kernels': such a layer has no step in C."""
    write_tiny(tmp_path / "llama.gguf", "llama")
    m = load_gguf_stored(tmp_path / "llama.gguf")
    engine = Engine(m.cfg, m.params)
    assert engine.layers_in_c == 0 and not engine.step_in_c


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("mode", list(ExpertSplit))
def test_routed_experts_in_the_step_equal_the_single_operations(
    tmp_path: Path, dtype: str, mode: ExpertSplit
) -> None:
    """Our own MoE file, its experts stored blocks: each layer's routed experts run in the
    step (``_routed_in_c``), one process and the pair, the same bits as the single path."""
    cfg = ModelConfig(
        n_ctx=64, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=64, n_expert=4, n_expert_used=2
    )
    path = tmp_path / "moe.gguf"
    save_gguf(path, cfg, init_params(cfg, seed=3), dtype=dtype)  # type: ignore[arg-type]
    params = load_gguf_stored(path).params
    engine = Engine(cfg, params, expert_split=mode)
    assert engine.layers_in_c == cfg.n_layer and all(engine._whole)
    prompt = list(range(5, 25))

    def greedy(in_c: bool) -> list[F32]:
        engine.step_in_c = in_c
        session = engine.new_session()
        out = [engine.decode(session, prompt)]
        for _ in range(STEPS):
            out.append(engine.decode(session, [int(np.argmax(out[-1][-1]))]))
        return out

    ref = greedy(False)
    assert same_bits(greedy(True), ref)
    ranks = [Engine(cfg, rank_weights(cfg, params, r, 2, mode), rank=r, world=2) for r in range(2)]
    ex = _Exchange()
    sessions = [e.new_session() for e in ranks]
    with ThreadPoolExecutor(1) as pool:

        def pair(tokens: list[int]) -> F32:
            job = pool.submit(ranks[1].decode, sessions[1], tokens, ex.for_rank(1))
            half0 = ranks[0].decode(sessions[0], tokens, ex.for_rank(0))
            return np.concatenate([half0, job.result(timeout=60)], axis=1)

        got = [pair(prompt)]
        for _ in range(STEPS):
            got.append(pair([int(np.argmax(got[-1][-1]))]))
    assert same_bits(got, ref)


_STEP_C = Path(__file__).resolve().parents[1] / "src/foundry/model/kernels/csrc/py_step.c"
# How each annotated field kind crosses into C: PyArg_ParseTuple's unit for it.
_C_UNIT = {"int": "i", "float": "f", "Address": "K"}


def _kinds(hints: dict[str, Any]) -> str:
    """The PyArg_ParseTuple units of a plan's fields, in order (a tuple or None: ``O``)."""
    return "".join(_C_UNIT.get(getattr(h, "__name__", ""), "O") for h in hints.values())


def _c_parse(function: str) -> tuple[str, list[str]]:
    """The format string and the argument names (``&p->n_q`` -> ``n_q``, ``&bias[0]`` ->
    ``bias``) of the first PyArg_ParseTuple in py_step.c's ``function``."""
    text = _STEP_C.read_text()
    found = re.search(rf"\b{function}\(", text)
    assert found is not None, f"no {function} in {_STEP_C.name}"
    body = text[found.start() :]
    call = body[body.index("PyArg_ParseTuple(") :]
    call = call[: call.index("))")]
    fmt = call.split('"')[1]
    names = [a.strip().lstrip("&") for a in call.split('"')[2].split(",")[1:]]
    return fmt.strip("()"), [n.split("->")[-1].split("[")[0] for n in names]


@pytest.mark.parametrize(
    ("cls", "function"),
    [
        (quant.StepMat, "parse_mat"),
        (quant.StepPart, "parse_part"),
        (quant.StepLayer, "py_step_plan"),
    ],
)
def test_step_plan_fields_follow_py_step_c(cls: type, function: str) -> None:
    """Each field of the plan sits where py_step.c reads it, as the kind it reads."""
    fmt, c_names = _c_parse(function)
    kinds = _kinds(typing.get_type_hints(cls))
    assert kinds == fmt, f"{cls.__name__}: {kinds} against py_step.c's {fmt}"
    assert len(c_names) == len(cls._fields)
    for field, c_name in zip(cls._fields, c_names, strict=True):
        assert c_name in field, f"{cls.__name__}.{field} is read in C as {c_name}"


def test_step_plan_check_reads_module_c() -> None:
    """The reading above sees the C format (a field moved would be caught)."""
    fmt, names = _c_parse("parse_part")
    assert fmt == "OOOOiiiiiiiiiiKKKKKiO" and names[:2] == ["qkv", "out"]
    swapped = typing.get_type_hints(quant.StepPart)
    swapped["n_q"], swapped["bias_q"] = swapped["bias_q"], swapped["n_q"]
    assert _kinds(typing.get_type_hints(quant.StepPart)) == fmt != _kinds(swapped)
