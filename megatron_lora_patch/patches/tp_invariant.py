"""`tp_invariant`: bitwise-identical LoRA training across TP = 1, 2, 4, with and without SP (opt-in).

docs/architecture.md section 7; techniques from Megatron-LM #4740 (dense full training there),
extended to the LoRA branch. Turn it on in every rank, before training, with
`megatron_lora_patch.apply(..., enable={"tp_invariant": True})` or the environment
variable `MEGATRON_LORA_PATCH_TP_INVARIANT=1`; it changes TP = 1 too (same code path).

What it changes (`megatron_lora_patch.tp_invariant` holds the math, `tp_invariant.hooks` the hooks):
- `ColumnParallelLinear._forward_impl` / `RowParallelLinear._forward_impl`: full GEMMs in
  the world-size-1 order with gathered weights (row: input gathered along K), the LoRA
  branch at full width, local slice taken afterwards; the row output is contributed by TP
  rank 0 only so Megatron's SUM over TP is exact (`tp_invariant.linear`). Replaces the
  `lora_linear` adapter call inside those layers while on.
- `MLP.__init__`: marks a gated (SwiGLU) fc1 so its `[gate_r; up_r]` shards are gathered
  into `[gate; up]` even where the weight's `partition_stride` is left at 1.
- `tensor_parallel.vocab_parallel_cross_entropy` (module and package re-export) and the
  language module's `fused_vocab_parallel_cross_entropy`: gathered logits, one reduction
  over the whole vocabulary (`tp_invariant.loss`).
- `MegatronOptimizer.get_grad_norm` / `clip_grad_norm`, `ChainedOptimizer.get_grad_norm`:
  float64 norm of the logical grads (`tp_invariant.grad_norm`).
- `lora.grad_sync.set_complete_domains({"tp"})` (a strategy, reset on revert): dense
  replicated factors leave the finalize SUM, because their grads are already complete on
  every rank (a SUM would multiply them by the TP size).

Not covered (they raise): MoE experts, pipeline parallelism, the distributed optimizer,
LoRA dropout, label smoothing, deferred embedding wgrad. Not covered (warned once): trainable
norm weights under SP (full training), whose grads stay per-rank partial sums; LoRA freezes
them. Transformer Engine linears/norms are not routed through this path (local specs only).
Megatron-Core >= 0.14, where `_forward_impl` is a method (0.12/0.13 reassign it per instance on every forward).
"""

from __future__ import annotations

from megatron_lora_patch.integrations import tp_invariant as hooks
from megatron_lora_patch.runtime.patching import PatchSpec

SPEC = PatchSpec(
    name="tp_invariant",
    summary="TP-invariant mode: full-width GEMMs, gathered-vocab cross entropy, float64 logical grad norm; "
    "LoRA training bitwise identical for TP=1/2/4 with and without SP (costs compute and memory)",
    hooks={
        "megatron.core.tensor_parallel.layers": hooks.patch_layers,
        "megatron.core.transformer.mlp": hooks.patch_mlp,
        "megatron.core.tensor_parallel": hooks.patch_cross_entropy,
        "megatron.core.models.common.language_module.language_module": hooks.patch_language_module,
        "megatron.core.optimizer.optimizer": hooks.patch_optimizer,
    },
    versions=">=0.14,<0.20",
    default=False,
)
