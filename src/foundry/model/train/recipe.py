"""The training recipe that learns on the default corpus: the defaults of every command that
trains (`foundry up`, `foundry train`, `foundry coordinator`), kept here so the demo and the
hand-run recipe give the same model for the same work.

3000 steps of the tiny preset, batch 16 x 64 bytes, peak learning rate 4e-3 with a warm-up of
60 steps, then cosine to a tenth: greedy text in words and
held-out bits per byte about half of cold ``gzip -9``'s (docs/benchmarks.md, "What the demo
learns"). Fewer steps stop in the "the the the" stage; the commands say so.
"""

from __future__ import annotations

STEPS = 3000
LR = 4e-3
GLOBAL_BATCH = 16
SEQ_LEN = 64
# Steps of `foundry up --long`: the longest run that still helps on the default corpus. 8000
# steps reach 1.620 held-out bits/byte against the default's 1.682; 12000 end at 1.689, the
# tiny model overfitting the corpus's 470 KB (docs/benchmarks.md).
LONG_STEPS = 8000

# Fine-tuning a published model (`--base-model`): a short run of small batches of longer
# sequences at a rate for adapters (LoRA's usual 1e-4 to 1e-3; full fine-tuning takes a tenth).
FT_STEPS = 200
FT_GLOBAL_BATCH = 8
FT_SEQ_LEN = 128
FT_LR_LORA = 1e-3
FT_LR_FULL = 1e-4


def warmup_steps(steps: int) -> int:
    """Linear warm-up of a run of ``steps``: a fiftieth of it, 20 to 60 steps (a run with a
    far-away end, ``--max-steps 1000000000``, still warms up in 60)."""
    return max(20, min(steps // 50, 60))


def validate_every(steps: int) -> int:
    """Steps between validation runs: a twentieth of the run, 25 to 150 steps apart (a pass
    costs about five steps of the tiny preset; a run with a far-away end still validates)."""
    return max(25, min(steps // 20, 150))


def short_run_note(steps: int, default_data: bool) -> str | None:
    """What to change when a run on the default corpus is too short to give words."""
    if not default_data or steps >= STEPS:
        return None
    return (
        f"note: {steps} steps are too few for words on the default corpus (the greedy "
        f"samples stay 'the the the ...'); --steps {STEPS} (the default) gives words"
    )
