"""`tp_invariant`: bitwise-identical LoRA training across TP = 1, 2, 4, with and without SP (opt-in).

docs/architecture.md section 7; techniques from Megatron-LM #4740 (dense full training there),
extended to the LoRA branch. Turn it on in every rank, before training, with
`megatron_lora_patch.apply(..., enable={"tp_invariant": True})` or the environment
variable `MEGATRON_LORA_PATCH_TP_INVARIANT=1`; it changes TP = 1 too (same code path).

What it changes (`megatron_lora_patch.invariant` holds the math):
- `ColumnParallelLinear._forward_impl` / `RowParallelLinear._forward_impl`: full GEMMs in
  the world-size-1 order with gathered weights (row: input gathered along K), the LoRA
  branch at full width, local slice taken afterwards; the row output is contributed by TP
  rank 0 only so Megatron's SUM over TP is exact (`invariant.linear`). Replaces the
  `lora_linear` adapter call inside those layers while on.
- `MLP.__init__`: marks a gated (SwiGLU) fc1 so its `[gate_r; up_r]` shards are gathered
  into `[gate; up]` even where the weight's `partition_stride` is left at 1.
- `tensor_parallel.vocab_parallel_cross_entropy` (module and package re-export) and the
  language module's `fused_vocab_parallel_cross_entropy`: gathered logits, one reduction
  over the whole vocabulary (`invariant.loss`).
- `MegatronOptimizer.get_grad_norm` / `clip_grad_norm`, `ChainedOptimizer.get_grad_norm`:
  float64 norm of the logical grads (`invariant.grad_norm`).
- `lora.grad_sync.replicated_adapter_params`: dense replicated factors leave the
  finalize SUM, because their grads are already complete on every rank (a SUM would
  multiply them by the TP size).

Not covered (they raise): MoE experts, pipeline parallelism, the distributed optimizer,
LoRA dropout, label smoothing, deferred embedding wgrad. Not covered (warned once): trainable
norm weights under SP (full training), whose grads stay per-rank partial sums; LoRA freezes
them. Transformer Engine linears/norms are not routed through this path (local specs only).
Megatron-Core >= 0.14, where `_forward_impl` is a method (0.12/0.13 reassign it per instance on every forward).
"""

from __future__ import annotations

import sys

from megatron_lora_patch.patching import PatchSpec

CROSS_ENTROPY_MODULE = "megatron.core.tensor_parallel.cross_entropy"


def _patch_layers(patcher, layers) -> None:
    from megatron_lora_patch.invariant.linear import column_forward_impl, row_forward_impl
    from megatron_lora_patch.runtime import SkipPatch

    for layer_class in (layers.ColumnParallelLinear, layers.RowParallelLinear):
        if "_forward_impl" not in vars(layer_class):
            raise SkipPatch(f"{layer_class.__name__}._forward_impl is not a method in this Megatron-Core (needs >= 0.14)")
    patcher.wrap(layers.ColumnParallelLinear, "_forward_impl", column_forward_impl)
    patcher.wrap(layers.RowParallelLinear, "_forward_impl", row_forward_impl)


def _mark_gated_fc1(wrapped, instance, args, kwargs):
    from megatron_lora_patch.invariant.linear import OUT_STRIDE_ATTRIBUTE

    wrapped(*args, **kwargs)
    if instance.config.gated_linear_unit and hasattr(instance.linear_fc1, "tp_group"):
        setattr(instance.linear_fc1, OUT_STRIDE_ATTRIBUTE, 2)


def _patch_mlp(patcher, mlp) -> None:
    patcher.wrap(mlp.MLP, "__init__", _mark_gated_fc1)


def _patch_cross_entropy(patcher, tensor_parallel) -> None:
    """Wrap the function in its module and point the package re-export at the same wrapper."""
    from megatron_lora_patch.invariant.loss import vocab_parallel_cross_entropy

    module = sys.modules[CROSS_ENTROPY_MODULE]
    original = module.vocab_parallel_cross_entropy
    patched = patcher.wrap(module, "vocab_parallel_cross_entropy", vocab_parallel_cross_entropy)
    if tensor_parallel.vocab_parallel_cross_entropy is original:
        patcher.replace(tensor_parallel, "vocab_parallel_cross_entropy", patched)


def _patch_language_module(patcher, language_module) -> None:
    from megatron_lora_patch.invariant.loss import fused_vocab_parallel_cross_entropy

    patcher.wrap(language_module, "fused_vocab_parallel_cross_entropy", fused_vocab_parallel_cross_entropy)


def _patch_optimizer(patcher, optimizer) -> None:
    from megatron_lora_patch.invariant import grad_norm

    patcher.wrap(optimizer.MegatronOptimizer, "get_grad_norm", grad_norm.get_grad_norm)
    patcher.wrap(optimizer.MegatronOptimizer, "clip_grad_norm", grad_norm.clip_grad_norm)
    patcher.wrap(optimizer.ChainedOptimizer, "get_grad_norm", grad_norm.chained_get_grad_norm)


def _dense_factors_leave_the_sum(wrapped, instance, args, kwargs):
    """Replicated factors of dense layers already hold their complete grad on every TP rank."""
    for param, info in wrapped(*args, **kwargs):
        if info.domain != "tp":
            yield param, info


def _patch_grad_sync(patcher, grad_sync) -> None:
    patcher.wrap(grad_sync, "replicated_adapter_params", _dense_factors_leave_the_sum)


SPEC = PatchSpec(
    name="tp_invariant",
    summary="TP-invariant mode: full-width GEMMs, gathered-vocab cross entropy, float64 logical grad norm; "
    "LoRA training bitwise identical for TP=1/2/4 with and without SP (costs compute and memory)",
    hooks={
        "megatron.core.tensor_parallel.layers": _patch_layers,
        "megatron.core.transformer.mlp": _patch_mlp,
        "megatron.core.tensor_parallel": _patch_cross_entropy,
        "megatron.core.models.common.language_module.language_module": _patch_language_module,
        "megatron.core.optimizer.optimizer": _patch_optimizer,
        "megatron_lora_patch.lora.grad_sync": _patch_grad_sync,
    },
    versions=">=0.14,<0.20",
    default=False,
)
