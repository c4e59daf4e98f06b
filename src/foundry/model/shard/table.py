"""The tensor-parallel cut as data (the package docstring has the theory): the gate enum
(a layer's two sync points), the split kinds and units, and ``SPLIT_TABLES``, the rule that cuts
each parameter in either expert split (``rule_for``)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from enum import Enum, IntEnum

from foundry.model.spec.config import ConfigError


class Gate(IntEnum):
    """The two sync points of a layer, where the ranks' partials are summed
    (DS4_TP_GATE_ATTN / _FFN); the TP gate header carries the value."""

    ATTN = 0
    FFN = 1


class SplitKind(Enum):
    REPLICATED = "replicated"  # every rank holds the whole tensor
    ROW = "row"  # axis 0 of an (out, in) matrix: the rank computes part of the outputs
    COLUMN = "column"  # axis 1: the rank reads part of the inputs, outputs are partial sums
    EXPERT = "expert"  # axis 0 of a merged (E, ., .) expert tensor
    EXPERT_ROW = "expert_row"  # axis 1 of (E, F, D) gate/up: part of every expert's outputs
    EXPERT_COLUMN = "expert_column"  # axis 2 of (E, D, F) down: partial sums of every expert
    VOCAB = "vocab"  # rows of the output head: the rank computes a block of the logits


class ExpertSplit(Enum):
    """How the routed experts are cut: the execution mode both ranks must agree on."""

    EXPERTS = "experts"  # contiguous blocks of whole experts (docs/decisions.md, D3)
    INTERMEDIATE = "intermediate"  # every expert, a block of its intermediate dimension


class Unit(Enum):
    """What a split counts; each unit spans ``unit_size`` elements of the cut axis."""

    HEAD = "head"  # a query head: head_dim columns of attn_output (the heads it attends for)
    KV_HEAD = "kv_head"  # a kv head: head_dim rows of V (the heads it caches)
    Q_ROWS = "q_rows"  # a query head's head_dim rows of Q (all of them under whole-vector
    # QK-norm, which needs the whole Q; else the rank's heads)
    K_ROWS = "k_rows"  # a kv head's head_dim rows of K (likewise)
    FF = "ff"  # one intermediate row of a dense FFN
    EXPERT = "expert"
    EXPERT_FF = "expert_ff"  # one intermediate row of every routed expert
    SHARED_FF = "shared_ff"  # one intermediate row of the shared expert
    VOCAB = "vocab"  # one token's row of the output head


AXIS = {
    SplitKind.ROW: 0,
    SplitKind.COLUMN: 1,
    SplitKind.EXPERT: 0,
    SplitKind.EXPERT_ROW: 1,
    SplitKind.EXPERT_COLUMN: 2,
    SplitKind.VOCAB: 0,
}


@dataclass(frozen=True)
class SplitRule:
    pattern: str  # fnmatch pattern over parameter names
    kind: SplitKind
    unit: Unit | None  # None for REPLICATED


SPLIT_TABLE: tuple[SplitRule, ...] = (
    SplitRule("token_embd.weight", SplitKind.REPLICATED, None),
    SplitRule("rope_freqs.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.attn_norm.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.attn_q.weight", SplitKind.ROW, Unit.Q_ROWS),
    SplitRule("blk.*.attn_k.weight", SplitKind.ROW, Unit.K_ROWS),
    SplitRule("blk.*.attn_v.weight", SplitKind.ROW, Unit.KV_HEAD),
    SplitRule("blk.*.attn_q.bias", SplitKind.ROW, Unit.Q_ROWS),
    SplitRule("blk.*.attn_k.bias", SplitKind.ROW, Unit.K_ROWS),
    SplitRule("blk.*.attn_v.bias", SplitKind.ROW, Unit.KV_HEAD),
    SplitRule("blk.*.attn_q_norm.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.attn_k_norm.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.attn_output.weight", SplitKind.COLUMN, Unit.HEAD),
    SplitRule("blk.*.post_attention_norm.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.ffn_norm.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.ffn_gate.weight", SplitKind.ROW, Unit.FF),
    SplitRule("blk.*.ffn_up.weight", SplitKind.ROW, Unit.FF),
    SplitRule("blk.*.ffn_down.weight", SplitKind.COLUMN, Unit.FF),
    SplitRule("blk.*.post_ffw_norm.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.ffn_gate_inp.weight", SplitKind.REPLICATED, None),
    SplitRule("blk.*.ffn_gate_exps.weight", SplitKind.EXPERT, Unit.EXPERT),
    SplitRule("blk.*.ffn_up_exps.weight", SplitKind.EXPERT, Unit.EXPERT),
    SplitRule("blk.*.ffn_down_exps.weight", SplitKind.EXPERT, Unit.EXPERT),
    SplitRule("blk.*.ffn_gate_shexp.weight", SplitKind.ROW, Unit.SHARED_FF),
    SplitRule("blk.*.ffn_up_shexp.weight", SplitKind.ROW, Unit.SHARED_FF),
    SplitRule("blk.*.ffn_down_shexp.weight", SplitKind.COLUMN, Unit.SHARED_FF),
    SplitRule("output_norm.weight", SplitKind.REPLICATED, None),
    SplitRule("output.weight", SplitKind.VOCAB, Unit.VOCAB),
)
"""The default table (``ExpertSplit.EXPERTS``)."""

# The rules of the expert tensors in each mode; SPLIT_TABLES puts them in SPLIT_TABLE's place.
EXPERT_RULES: dict[ExpertSplit, tuple[SplitRule, ...]] = {
    ExpertSplit.EXPERTS: tuple(r for r in SPLIT_TABLE if r.kind is SplitKind.EXPERT),
    ExpertSplit.INTERMEDIATE: (
        SplitRule("blk.*.ffn_gate_exps.weight", SplitKind.EXPERT_ROW, Unit.EXPERT_FF),
        SplitRule("blk.*.ffn_up_exps.weight", SplitKind.EXPERT_ROW, Unit.EXPERT_FF),
        SplitRule("blk.*.ffn_down_exps.weight", SplitKind.EXPERT_COLUMN, Unit.EXPERT_FF),
    ),
}


def _with_expert_rules(rules: tuple[SplitRule, ...]) -> tuple[SplitRule, ...]:
    by_pattern = {r.pattern: r for r in rules}
    table = tuple(by_pattern.get(r.pattern, r) for r in SPLIT_TABLE)
    assert set(by_pattern) <= {r.pattern for r in SPLIT_TABLE}
    return table


SPLIT_TABLES: dict[ExpertSplit, tuple[SplitRule, ...]] = {
    mode: _with_expert_rules(rules) for mode, rules in EXPERT_RULES.items()
}
assert SPLIT_TABLES[ExpertSplit.EXPERTS] == SPLIT_TABLE


class SplitError(ConfigError):
    """A model that cannot be cut for the requested world size (names the field and value)."""


def rule_for(name: str, expert_split: ExpertSplit = ExpertSplit.EXPERTS) -> SplitRule:
    for rule in SPLIT_TABLES[expert_split]:
        if fnmatch.fnmatchcase(name, rule.pattern):
            return rule
    raise KeyError(f"no tensor-parallel split rule for parameter {name!r}")
