"""TP-invariant mode: the same bits for TP = 1, 2, 4 (docs/architecture.md section 7).

Plain modules, installed by the `layout_invariant` patch (formerly `tp_invariant`; its hooks are in
`megatron_lora_patch.patches.layout_invariant`):
- `shares`: the fixed partition of a sharded dimension (segments, chunks) and the canonical tree;
- `collectives`: the tree combine over TP (an all-gather of partial sums) and the activation gather;
- `segmented`: column- and row-parallel linears (base + LoRA) on the local weight shards;
- `linear`: their wrappers of Megatron's `_forward_impl`;
- `loss`: vocab-parallel cross entropy on the gathered logits;
- `grad_norm`: the grad norm of the logical (gathered) grads in float64.

Why it works: on CPU as on GPU, what changes bits across TP degrees is a reduction split
into per-rank partial sums (row-parallel outputs, column-parallel input grads, replicated
LoRA factor grads, vocab sums, grad-norm squares), and GEMM shapes that change with the TP
degree. Here every sum over a sharded dimension is formed in one canonical order fixed by
the width alone (chained inside a segment, a binary tree over the segments whose TP splits
are subtrees), every GEMM has a shape fixed by the width alone, and the vocab and norm sums
run over the gathered operand; TP = 1 runs the same code. No rank holds a full base weight.
"""

from megatron_lora_patch.runtime.errors import UsageError


class TPInvariantUnsupported(UsageError, ValueError):
    """The TP-invariant mode cannot run this configuration bit-exactly; the message says what to change (a
    `UsageError`: an uncaught one is one line, e.g. in a Megatron-LM run)."""

