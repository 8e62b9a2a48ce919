"""TP-invariant mode: the same bits for TP = 1, 2, 4 (docs/architecture.md section 7).

Plain modules, installed by the `tp_invariant` patch:
- `collectives`: gather-to-logical / local-slice autograd duals and an exact row reduction;
- `linear`: column- and row-parallel linears (base + LoRA) as full, world-size-1 GEMMs;
- `loss`: vocab-parallel cross entropy on the gathered logits;
- `grad_norm`: the grad norm of the logical (gathered) grads in float64;
- `hooks`: what the patch installs on each Megatron-Core target.

Why it works: on CPU as on GPU, what changes bits across TP degrees is a reduction split
into per-rank partial sums (row-parallel outputs, column-parallel input grads, replicated
LoRA factor grads, vocab sums, grad-norm squares). Here every such reduction runs once,
over the full operand, in the world-size-1 order, on every rank; TP = 1 runs the same code.
"""


class TPInvariantUnsupported(ValueError):
    """The TP-invariant mode cannot run this configuration bit-exactly; the message says what to change."""

