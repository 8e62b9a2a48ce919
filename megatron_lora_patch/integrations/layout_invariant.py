"""The hooks the `layout_invariant` patch installs (docs/architecture.md section 7): the per-layer
TP-invariant math (`layout_invariant.tensor_parallel.linear`, `loss`, `grad_norm`) and, for DP / PP, Megatron DDP's grad
accumulation and DP reduction in the canonical tree plus the microbatch numbering in the schedules
(`layout_invariant.lanes`), and MoE experts on fixed token chunks (`layout_invariant.experts`).
"""

from __future__ import annotations

import sys

CROSS_ENTROPY_MODULE = "megatron.core.tensor_parallel.cross_entropy"


def patch_layers(patcher, layers) -> None:
    """Column / row parallel linears on their local shards, each sum over a sharded dimension in one canonical tree."""
    from megatron_lora_patch.layout_invariant.tensor_parallel.linear import column_forward_impl, row_forward_impl
    from megatron_lora_patch.lora.training import grad_sync
    from megatron_lora_patch.runtime.registry import SkipPatch

    for layer_class in (layers.ColumnParallelLinear, layers.RowParallelLinear):
        if "_forward_impl" not in vars(layer_class):
            raise SkipPatch(
                f"{layer_class.__name__}._forward_impl is not a method in this Megatron-Core (needs >= 0.14)"
            )
    patcher.wrap(layers.ColumnParallelLinear, "_forward_impl", column_forward_impl)
    patcher.wrap(layers.RowParallelLinear, "_forward_impl", row_forward_impl)
    # Their replicated LoRA factors get complete grads on every TP (and expert TP) rank (the tree
    # combine over the layer's TP group runs inside the layer), and the finalize SUM would multiply
    # them by the group size.
    previous = grad_sync.set_complete_domains({"tp", "expert_tp"})
    patcher.on_revert(lambda: grad_sync.set_complete_domains(previous))


def _mark_gated_fc1(wrapped, instance, args, kwargs):
    from megatron_lora_patch.layout_invariant.tensor_parallel.linear import OUT_STRIDE_ATTRIBUTE

    wrapped(*args, **kwargs)
    if instance.config.gated_linear_unit and hasattr(instance.linear_fc1, "tp_group"):
        setattr(instance.linear_fc1, OUT_STRIDE_ATTRIBUTE, 2)


def patch_mlp(patcher, mlp) -> None:
    """A gated (SwiGLU) fc1 is gathered as `[gate; up]` even where its partition_stride is 1."""
    patcher.wrap(mlp.MLP, "__init__", _mark_gated_fc1)


def patch_cross_entropy(patcher, tensor_parallel) -> None:
    """Wrap the function in its module and the package re-export with it."""
    from megatron_lora_patch.layout_invariant.tensor_parallel.loss import vocab_parallel_cross_entropy

    patcher.wrap(sys.modules[CROSS_ENTROPY_MODULE], "vocab_parallel_cross_entropy", vocab_parallel_cross_entropy,
                 reexported_by=(tensor_parallel.__name__,))


def patch_language_module(patcher, language_module) -> None:
    """The fused cross entropy on gathered logits too."""
    from megatron_lora_patch.layout_invariant.tensor_parallel.loss import fused_vocab_parallel_cross_entropy

    patcher.wrap(language_module, "fused_vocab_parallel_cross_entropy", fused_vocab_parallel_cross_entropy)


def patch_optimizer(patcher, optimizer) -> None:
    """The grad norm (and clipping) of the logical grads in float64."""
    from megatron_lora_patch.layout_invariant.tensor_parallel import grad_norm

    patcher.wrap(optimizer.MegatronOptimizer, "get_grad_norm", grad_norm.get_grad_norm)
    patcher.wrap(optimizer.MegatronOptimizer, "clip_grad_norm", grad_norm.clip_grad_norm)
    patcher.wrap(optimizer.ChainedOptimizer, "get_grad_norm", grad_norm.chained_get_grad_norm)


_STATE = {"active": False}


def is_active() -> bool:
    """Whether the layout-invariant patch is applied in this process (the testbed's loss report asks)."""
    return _STATE["active"]


def patch_ddp(patcher, ddp) -> None:
    """Per-microbatch grads into lanes, the lane tree instead of DDP's all-reduce. (`__init__` is the
    loss_normalization patch's: each DDP module gets its lanes, after the mode's checks, on first use.)"""
    from megatron_lora_patch.layout_invariant import lanes

    owner = ddp.DistributedDataParallel
    patcher.wrap(owner, "_make_backward_post_hook", lanes.make_backward_post_hook)
    patcher.wrap(owner, "zero_grad_buffer", lanes.zero_grad_buffer)
    patcher.wrap(owner, "finish_grad_sync", lanes.finish_grad_sync)
    _STATE["active"] = True
    patcher.on_revert(lambda: _STATE.update(active=False))


def patch_experts(patcher, experts) -> None:
    """SequentialMLP experts on fixed-size token chunks per global microbatch (`layout_invariant.experts`)."""
    from megatron_lora_patch.layout_invariant import experts as chunked

    patcher.wrap(experts.SequentialMLP, "forward", chunked.sequential_forward)


def patch_token_dispatcher(patcher, token_dispatcher) -> None:
    """The allgather and alltoall dispatchers hand each local expert's per-source token counts to the experts."""
    from megatron_lora_patch.layout_invariant import experts as chunked

    patcher.wrap(token_dispatcher.MoEAllGatherTokenDispatcher, "dispatch_postprocess",
                 chunked.allgather_dispatch_postprocess)
    patcher.wrap(token_dispatcher.MoEAlltoAllTokenDispatcher, "dispatch_preprocess",
                 chunked.alltoall_dispatch_preprocess)


def patch_schedules(patcher, schedules) -> None:
    """Number the microbatches whose backward runs (every schedule calls the module's `backward_step`)."""
    from megatron_lora_patch.layout_invariant import lanes

    patcher.wrap(schedules, "backward_step", lanes.counted_backward_step)
