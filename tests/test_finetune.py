"""Fine-tuning a published model: the training forward against the inference engine, per
architecture; LoRA's start, merge and adapter file; the user's data.

The training forward (``finetune.Model``, PyTorch) and the inference engine (``inference.Engine``,
numpy and C) are two programs of one architecture table; on the same float32 weights their
logits agree to float accuracy (measured at most 3e-5 of a row's largest magnitude on the tiny
files; the test allows 2e-4). The real Gemma file is compared on its weights dequantized to
float32 (the engine then multiplies in float32 too): 4.6e-4 over 18 layers, allowed 1e-3.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
from published import TINY, prompts, write_tiny

torch = pytest.importorskip("torch")

from foundry.model.formats import lora as LR  # noqa: E402
from foundry.model.formats.gguf_io import load_gguf  # noqa: E402
from foundry.model.infer.inference import Engine  # noqa: E402
from foundry.model.infer.kv_cache import KVCache  # noqa: E402
from foundry.model.train import finetune as FT  # noqa: E402
from foundry.model.train import finetune_backend as FB  # noqa: E402

REL_TOL = 2e-4


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tiny")
    out = {}
    for name in TINY:
        out[name] = folder / f"{name}.gguf"
        write_tiny(out[name], name)
    return out


def engine_logits(path: Path, ids: list[int]) -> np.ndarray:
    m = load_gguf(path)
    engine = Engine(m.cfg, m.params, kv_cache=KVCache.F32, ctx_size=max(64, len(ids)))
    return engine.decode(engine.new_session(), ids)


def training_logits(
    base: FT.Base,
    ids: list[int],
    trainable: dict[str, torch.Tensor] | None = None,
    spec: LR.LoraSpec | None = None,
) -> np.ndarray:
    model = FT.Model(base, spec)
    with torch.no_grad():
        out = model.forward(trainable or {}, torch.tensor([ids]))
    return out[0].numpy()


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.max(np.abs(b), axis=-1, keepdims=True)))


@pytest.mark.parametrize("name", sorted(TINY))
def test_training_forward_equals_the_engine(files: dict[str, Path], name: str) -> None:
    base = FT.load_base(files[name])
    for ids in prompts(name):
        ours, theirs = training_logits(base, ids), engine_logits(files[name], ids)
        assert ours.shape == theirs.shape
        assert rel_err(ours, theirs) < REL_TOL, name


def test_sliding_window_is_applied(files: dict[str, Path]) -> None:
    # gemma3's tiny file has a window of 5: a 14-token prompt's late rows depend on it.
    base = FT.load_base(files["gemma3"])
    ids = prompts("gemma3")[1]
    assert len(ids) > 5 + 1
    ours = training_logits(base, ids)
    # The same layers (and rope bases) with a window longer than the prompt.
    wide = FT.Model(
        dataclasses.replace(base, cfg=dataclasses.replace(base.cfg, sliding_window=1000)), None
    )
    with torch.no_grad():
        unwindowed = wide.forward({}, torch.tensor([ids]))[0].numpy()
    assert np.allclose(ours[:5], unwindowed[:5], atol=1e-5)
    assert rel_err(ours[-1:], unwindowed[-1:]) > 1e-3


def gemma_file() -> Path:
    path = Path(
        os.environ.get("FOUNDRY_GEMMA_GGUF")
        or Path.home() / ".cache" / "foundry" / "gemma-3-270m-q4_k_m.gguf"
    )
    if not path.exists():
        pytest.skip("the Gemma file is not assembled (FOUNDRY_GEMMA_GGUF)")
    return path


def test_gemma_file_forward_equals_the_engine() -> None:
    path = gemma_file()
    base = FT.load_base(path)
    ids = [2, 818, 5279, 529, 7001, 563, 9079, 236761]  # <bos> and a short sentence
    ours = training_logits(base, ids)
    theirs = engine_logits(path, ids)
    # 18 layers of float32 in two summation orders, each GELU looked up at a float16 input
    # that a last-bit difference can move: measured 4.6e-4 of the row's largest logit.
    assert rel_err(ours, theirs) < 1e-3
    assert int(ours[-1].argmax()) == int(theirs[-1].argmax())


# -- LoRA --------------------------------------------------------------------------------------


def adapters_on(
    base: FT.Base, spec: LR.LoraSpec, seed: int = 0, b_scale: float = 0.0
) -> dict[str, np.ndarray]:
    """Fresh adapters; with ``b_scale`` B random too (a trained adapter's stand-in)."""
    out = LR.init_adapters(base.cfg, spec, seed)
    rng = np.random.default_rng(seed + 1)
    for name in out:
        if name.endswith(LR.SUFFIX_B) and b_scale:
            out[name] = (rng.standard_normal(out[name].shape) * b_scale).astype(np.float32)
    return out


def as_torch(params: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(a) for n, a in params.items()}


def test_lora_defaults_are_peft_s() -> None:
    spec = LR.LoraSpec()
    assert (spec.rank, spec.alpha, spec.dropout, spec.targets) == (
        8,
        8.0,
        0.0,
        ("attn_q", "attn_v"),
    )
    with pytest.raises(LR.LoraError, match="--lora-targets"):
        LR.LoraSpec(targets=("q_proj",))
    with pytest.raises(LR.LoraError, match="--lora-rank"):
        LR.LoraSpec(rank=0)


def test_fresh_adapters_leave_the_model_as_it_was(files: dict[str, Path]) -> None:
    base = FT.load_base(files["qwen3"])
    spec = LR.LoraSpec(rank=4, targets=LR.TARGETS)
    adapters = adapters_on(base, spec)
    assert all(not a.any() for n, a in adapters.items() if n.endswith(".lora_b"))
    ids = prompts("qwen3")[0]
    assert np.array_equal(
        training_logits(base, ids, as_torch(adapters), spec), training_logits(base, ids)
    )


@pytest.mark.parametrize("name", ["qwen2", "gemma3", "llama", "qwen3moe", "olmoe"])
def test_lora_forward_equals_the_merged_model(files: dict[str, Path], name: str) -> None:
    base = FT.load_base(files[name])
    moe = base.cfg.n_expert > 0  # the routed experts stay frozen: adapters on attention
    spec = LR.LoraSpec(rank=3, alpha=6.0, targets=LR.TARGETS[:4] if moe else LR.TARGETS)
    adapters = adapters_on(base, spec, b_scale=0.2)
    params = {n: t.numpy() for n, t in base.weights.items()}
    merged = LR.merge(params, adapters, spec.scale)
    assert not np.array_equal(merged["blk.0.attn_q.weight"], params["blk.0.attn_q.weight"])
    ids = prompts(name)[1]
    lora = training_logits(base, ids, as_torch(adapters), spec)
    # full fine-tuning's forward takes the merged tensors in place of the base's
    full = training_logits(base, ids, as_torch(merged))
    # (gemma3's GELU is looked up at float16 inputs: a last-bit change of an input may move
    # it a float16 step, 2.6e-4 measured)
    tol = 1e-3 if name == "gemma3" else 1e-5
    assert rel_err(lora, full) < tol
    # and the engine on the merged weights agrees
    m = load_gguf(files[name])
    engine = Engine(m.cfg, LR.merge(m.params, adapters, spec.scale), kv_cache=KVCache.F32)
    assert rel_err(lora, engine.decode(engine.new_session(), ids)) < max(tol, REL_TOL)


def test_moe_experts_stay_frozen(files: dict[str, Path]) -> None:
    base = FT.load_base(files["qwen3moe"])
    with pytest.raises(LR.LoraError, match="routed experts"):
        LR.adapter_shapes(base.cfg, LR.LoraSpec(targets=("attn_q", "ffn_up")))
    from foundry.model.formats.tuning import trainable_shapes

    full = trainable_shapes(base.cfg, None)
    assert not any("_exps" in n for n in full) and "blk.0.attn_q.weight" in full


def test_only_the_adapters_train(files: dict[str, Path]) -> None:
    from foundry.model.text.data import Corpus

    base = FT.load_base(files["llama"])
    spec = LR.LoraSpec(rank=2)
    backend = FB.FineTuneBackend(base, spec)
    rng = np.random.default_rng(0)
    corpus = Corpus(rng.integers(3, base.cfg.n_vocab, 400).astype(np.int32), "random", 1)
    before = {n: t.clone() for n, t in base.weights.items()}
    start = adapters_on(base, spec)
    result = backend.compute_gradients(start, base.cfg, corpus, 0, 4, seq_len=16)
    assert set(result.grads) == set(start)
    # B is zero, so A's gradient is zero; B's is not
    assert all(not g.any() for n, g in result.grads.items() if n.endswith(".lora_a"))
    assert all(g.any() for n, g in result.grads.items() if n.endswith(".lora_b"))
    tuner = FB.FineTuner(backend, FB.TuneSettings(4, 16, 1e-2, 3), start)
    for _ in range(3):
        tuner.train_step(corpus)
    trained = tuner.host_params()
    assert all(not np.array_equal(trained[n], start[n]) for n in start)
    assert all(torch.equal(before[n], base.weights[n]) for n in before)


def test_adapter_file_round_trips(files: dict[str, Path], tmp_path: Path) -> None:
    base = FT.load_base(files["qwen3"])
    spec = LR.LoraSpec(rank=4, alpha=16.0)
    adapters = adapters_on(base, spec, b_scale=0.1)
    path = tmp_path / "adapter.gguf"
    LR.save_adapter(path, "qwen3", spec.alpha, adapters)
    got = LR.load_adapter(path)
    assert (got.architecture, got.alpha, got.rank) == ("qwen3", 16.0, 4)
    assert got.tensors.keys() == adapters.keys()
    assert all(np.array_equal(got.tensors[n], adapters[n]) for n in adapters)
    from foundry.model.formats import gguf_meta

    meta = gguf_meta.read_metadata(path)
    assert (meta["general.type"], meta["adapter.type"]) == ("adapter", "lora")
    with pytest.raises(LR.LoraError, match="is an adapter for 'qwen3'"):
        LR.apply_adapter(FT.load_base(files["qwen2"]).cfg, {}, got, str(path))
    with pytest.raises(LR.LoraError, match="not a LoRA adapter"):
        LR.load_adapter(files["qwen3"])


# -- the user's data ---------------------------------------------------------------------------


def test_text_and_chat_data(files: dict[str, Path], tmp_path: Path) -> None:
    import json

    from foundry.model.text.chat import template_for
    from foundry.model.text.data import NOT_COUNTED, DataError
    from foundry.model.text.finetune_data import conversation_segments, load_tuning_corpus
    from foundry.model.text.vocab import load_tokenizer

    meta = load_gguf(files["qwen3"]).metadata
    tok = load_tokenizer(meta)
    text = tmp_path / "notes.txt"
    text.write_text("ab ac ad " * 40)
    corpus = load_tuning_corpus(text, tok)
    assert corpus.tokens[0] == tok.bos_id and corpus.tokens[-1] == tok.eos_id
    assert corpus.counted is None

    template = template_for(meta)  # no turn tokens: the plain transcript
    talk = [{"role": "user", "content": "ab ac"}, {"role": "assistant", "content": "ad ae"}]
    segments = conversation_segments(template, [type("M", (), m)() for m in talk])  # type: ignore
    assert [c for _, c in segments] == [False, True]
    assert segments[1][0] == " ad ae\n"
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": talk}) for _ in range(30)) + "\n")
    corpus = load_tuning_corpus(chat, tok, template)
    assert corpus.counted is not None and 0 < corpus.counted.mean() < 1
    reply = tok.encode(" ad ae\n", add_special=False)
    first = corpus.tokens[corpus.counted][: len(reply)].tolist()
    assert first == reply
    _, targets = corpus.sample_batch(0, 4, 8)
    assert (targets == NOT_COUNTED).any() and (targets != NOT_COUNTED).any()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: the conversation has no assistant"):
        load_tuning_corpus(bad, tok, template)


def test_gemma_chat_turns_count_the_reply_and_its_end_of_turn() -> None:
    from foundry.model.formats import gguf_meta
    from foundry.model.text.chat import Message, template_for
    from foundry.model.text.finetune_data import conversation_segments

    meta = gguf_meta.read_metadata(gemma_file())
    assert template_for(meta).name.startswith("plain")  # the file has none
    template = template_for(meta, "gemma")  # Gemma's built-in turns, asked for by name
    talk = [
        Message("user", "How do I reset it?"),
        Message("assistant", "Hold the button."),
        Message("user", "Thanks"),
        Message("assistant", "You are welcome."),
    ]
    segments = conversation_segments(template, talk)
    assert [text for text, counted in segments if counted] == [
        "Hold the button.<end_of_turn>\n",
        "You are welcome.<end_of_turn>\n",
    ]
    assert "".join(text for text, _ in segments) == template.render(
        talk, add_generation_prompt=False
    ).removeprefix(template.bos_token)


def test_a_template_that_rewrites_old_turns_counts_the_replies_it_prints() -> None:
    from foundry.model.text.chat import ChatTemplate, Message
    from foundry.model.text.finetune_data import conversation_segments

    # Marks only the last assistant turn's (empty) reasoning, as Qwen3's template does: no
    # rendering of a turn is a prefix of the next one's.
    source = (
        "{% for m in messages %}<{{ m.role }}>"
        "{% if m.role == 'assistant' and loop.last %}<think></think>{% endif %}"
        "{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    t = ChatTemplate(source, "rewrites")
    talk = [
        Message("user", "a"),
        Message("assistant", "b"),
        Message("user", "c"),
        Message("assistant", "d"),
    ]
    segments = conversation_segments(t, talk)
    assert [text for text, counted in segments if counted] == ["b", "d"]
    assert "".join(text for text, _ in segments) == t.render(talk, add_generation_prompt=False)


@pytest.mark.parametrize("name", ["qwen3", "qwen3moe"])
def test_a_base_held_quantized_trains_as_the_dequantized_one(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """``keep_quantized``: the matrices of a Q8_0 file stay Q8_0 in memory and are dequantized
    a slice at a time (slices of 200 values here, so every product is cut in several) in the
    forward and again in the backward; the loss and the adapters' gradient are those of the
    same file dequantized at load."""
    import gguf

    from foundry.model.formats.gguf_rewrite import rewrite_gguf
    from foundry.model.kernels.quant import QTensor
    from foundry.model.text.data import Corpus

    q8 = tmp_path / f"{name}-q8.gguf"
    dense_src = load_gguf(files[name])
    rewrite_gguf(
        files[name],
        q8,
        {n: a for n, a in dense_src.params.items() if a.ndim >= 2},
        forced=gguf.GGMLQuantizationType.Q8_0,
    )
    monkeypatch.setattr(FT, "SLICE_VALUES", 200)
    dense, held = FT.load_base(q8), FT.load_base(q8, keep_quantized=True)
    kept = [n for n, w in held.weights.items() if isinstance(w, QTensor)]
    assert "token_embd.weight" in kept and "blk.0.attn_q.weight" in kept
    assert held.nbytes() < 0.4 * dense.nbytes()
    spec = LR.LoraSpec(rank=2, targets=LR.TARGETS if name == "qwen3" else ("attn_q", "attn_v"))
    rng = np.random.default_rng(0)
    corpus = Corpus(rng.integers(3, dense.cfg.n_vocab, 400).astype(np.int32), "random", 1)
    start = adapters_on(dense, spec, b_scale=0.1)  # B not zero: A has a gradient too
    a = FB.FineTuneBackend(dense, spec).compute_gradients(
        start, dense.cfg, corpus, 0, 4, seq_len=16
    )
    b = FB.FineTuneBackend(held, spec).compute_gradients(start, held.cfg, corpus, 0, 4, seq_len=16)
    assert abs(a.loss - b.loss) <= 1e-6 * abs(a.loss)
    assert set(a.grads) == set(b.grads) == set(start)
    for n in a.grads:
        scale = float(np.max(np.abs(a.grads[n])))
        assert scale > 0, n
        assert float(np.max(np.abs(a.grads[n] - b.grads[n]))) <= 1e-5 * scale, n
