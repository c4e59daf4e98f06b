"""Tensor-parallel slicing as data: which part of each parameter rank r of w holds
(docs/decisions.md, D3).

Every parameter name matches one rule of ``SPLIT_TABLE``: a split kind (which axis is cut)
and the unit it counts (query heads, kv heads, experts, shared-expert intermediate rows,
vocabulary rows). Rank r owns the r-th contiguous block of units.

Shares. The ranks of a world of N need not hold equal blocks: each has a *share*, a positive
integer weight (``--shares 2,1,1``: rank 0 holds about half of every unit, ranks 1 and 2 a
quarter each), so a slow machine holds the smaller slice instead of gating everyone. Rank r's
block of n units is its quota ``n * share_r / sum(shares)``, rounded by largest remainder (whole
quotas first, then one more unit to the ranks with the largest fractions, the earlier rank
first on a tie: :func:`share_range`). Equal shares give the plain blocks, the first ``n %
world`` ranks taking one more unit (rank 0 of 2 gets the first ceil(V/2) rows of the output
head): the pair of two equal ranks is cut exactly as before shares existed. Shares are
reduced by their greatest common divisor, so ``2,2`` is ``1,1``.

The limits (:func:`check_splittable`): every rank must hold at least one unit of what it
computes (a kv head, or a query head when the model has a single kv head; a block of
the dense FFN; an expert, or a row of every expert's intermediate dimension; a row of the
shared expert; a vocabulary row), and column cuts of stored blocks fall on whole blocks
(:func:`shard_part`). A world size or shares the model cannot take raise :class:`SplitError`,
one line naming the unit and the nearest world size or shares that work.

The routed experts are cut one of two ways, the :class:`ExpertSplit` (the execution mode both ranks
of a pair must agree on): ``EXPERTS``, the first design (docs/decisions.md, D3), gives each rank a
contiguous block of whole experts; ``INTERMEDIATE`` gives each rank every expert but only its block
of each expert's intermediate dimension (gate/up rows along n_ff, down columns along n_ff). The mode
selects the rules of the three expert tensors (:data:`SPLIT_TABLES`); every other rule is shared.

What each rank computes with its slice, per layer:

- ATTN gate: the output projection of its heads' attention (its columns of ``attn_output``
  times its heads' outputs, from its rows of Q/K/V): an (n_rows, n_embd) partial.
- FFN gate: the outputs of its routed experts plus its slice of the shared expert's
  intermediate rows: an (n_rows, n_embd) partial. The router is replicated, so every rank
  computes the same full routing. With ``EXPERTS`` a rank skips the assignments to experts it
  does not hold (when both of a token's experts sit on one rank, the other idles at the gate);
  with ``INTERMEDIATE`` it evaluates every assignment on its half of the expert:
  ``w * down[:, half] @ (silu(gate[half] x) * up[half] x)``. SwiGLU is elementwise over the
  intermediate dimension, so the two halves' sum is the whole expert, and both ranks do the
  same work for every token.
- The partials of all ranks are summed and added to the residual stream on every rank.
- The output head gives each rank its vocabulary block of the logits; the blocks, joined in
  rank order, are the full logits.

Embeddings and norms are replicated. Query head h reads kv head h // (n_head / n_head_kv), so a
rank owning a contiguous block of whole kv heads owns exactly the query heads reading them
(:func:`attention_split`: uneven blocks for an odd count of kv heads; K and V replicated, query
heads split, when there are fewer kv heads than ranks; kv heads handed out in groups where the
file's blocks would cut attn_output inside a block, :func:`kv_group_for`, so a rank may hold no
heads). A dense FFN is cut by its intermediate rows (gate/up rows, down columns), in the largest
block (256, 32) that divides them. A tied output
head (no ``output.weight``) is the replicated ``token_embd``, each rank reading its vocabulary
block of rows.

Weights kept in their stored type (``quant.QTensor``) are cut the same way, along whole blocks:
a cut of the last axis (the COLUMN and EXPERT_COLUMN kinds, where the rank reads part of each
row) must fall on a block boundary of the tensor's type, else :class:`SplitError` names the
tensor and its block size (``slices.check_cuts`` checks every rank's cuts against the file's
blocks at once; ``slices.pick_expert_split`` picks the expert split whose cuts fit). Cuts of
the other axes take whole rows and never split a block.
"""
