"""`layout_invariant`: bitwise-identical LoRA training across TP = 1/2/4 (with or without SP),
DP = 1/2/4/8, PP = 1/2/... and (MoE, tp 1/2/4) EP = 1/2/4 x ETP = 1/2 with a fixed global batch and micro batch
size (opt-in).

docs/architecture.md section 7; the TP techniques from Megatron-LM #4740 (dense full training
there), extended to the LoRA branch, data and pipeline parallelism. Turn it on in every rank,
before training, with `megatron_lora_patch.apply(..., enable={"layout_invariant": True})` or
`MEGATRON_LORA_PATCH_LAYOUT_INVARIANT=1` (the old name `tp_invariant` still works, with a
deprecation warning); it changes world size 1 too (same code path).

What it changes (the hooks below route each target to the mode's library, `megatron_lora_patch.layout_invariant`,
its `tensor_parallel` subpackage the per-layer math; `is_active()` tells the testbed's loss report it is on):
- `ColumnParallelLinear._forward_impl` / `RowParallelLinear._forward_impl`: base + LoRA on the
  local shards in fixed-shape chunks, every sum over a sharded dimension in one canonical segment
  tree finished over TP by an all-gather of activation-sized partials; no rank holds a full base
  weight (`layout_invariant.tensor_parallel.linear`, `segmented`, `shares`); replaces the `lora_linear`
  adapter call inside those layers while on. `MLP.__init__` marks a gated fc1's stride.
- `tensor_parallel.vocab_parallel_cross_entropy` (and its re-export) and the language module's
  `fused_vocab_parallel_cross_entropy`: one reduction over the whole vocabulary.
- `MegatronOptimizer.get_grad_norm` / `clip_grad_norm`, `ChainedOptimizer.get_grad_norm`:
  float64 norm of the logical grads, summed exactly over parameters and pipeline stages.
- `DistributedDataParallel.__init__` / `_make_backward_post_hook` / `zero_grad_buffer` /
  `finish_grad_sync` and `schedules.backward_step`: each microbatch's grad goes into the lane
  of its global microbatch index; the lanes and the DP partials are summed in one canonical
  tree (an all-gather replaces DDP's all-reduce / reduce-scatter) (`layout_invariant.lanes`).
- `SequentialMLP.forward`, `MoEAllGatherTokenDispatcher.dispatch_postprocess`,
  `MoEAlltoAllTokenDispatcher.dispatch_preprocess`: each local expert
  runs on each microbatch's tokens (its sequence shards joined) in fixed-size chunks; its grads go into
  the lanes of their global microbatches, combined over all lanes under ep > 1 (`layout_invariant.experts`,
  `layout_invariant.expert_lanes`);
  the router probabilities are applied on `linear_fc2`'s input with a canonical grad (`layout_invariant.expert_probs`).
- `lora.grad_sync.set_complete_domains({"tp", "expert_tp"})`: replicated factors (dense and
  expert) leave the finalize SUM (their grads are complete on every rank).

Not covered (refused with one line before any step): MoE at tp > 4 or with tp not dividing etp * ep, etp > 2
unless etp = tp, etp > tp without ep, top-k > 2,
aux / z losses, token dropping, grouped GEMM, the flex dispatcher, shared experts, linear biases in MoE
models; context parallelism, virtual
pipeline stages, overlapped grad reduction, several distributed-optimizer instances, DP sizes
not dividing 8, dropout, LoRA dropout, label smoothing, trainable tied embeddings under PP,
the legacy (non per-token) loss, deferred embedding wgrad. Transformer Engine linears are not
routed through this path (local specs only). Megatron-Core >= 0.14.
"""

from __future__ import annotations

import sys

from megatron_lora_patch.patches import tested_range
from megatron_lora_patch.runtime.patching import PatchSpec

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


SPEC = PatchSpec(
    name="layout_invariant",
    summary="layout-invariant mode: world-size-1 GEMM order, full-vocabulary cross entropy, exact float64 grad "
    "norm, microbatch grads summed in one canonical tree; LoRA training bitwise identical across TP x DP x PP "
    "(costs compute and memory)",
    hooks={
        "megatron.core.tensor_parallel.layers": patch_layers,
        "megatron.core.transformer.mlp": patch_mlp,
        "megatron.core.tensor_parallel": patch_cross_entropy,
        "megatron.core.models.common.language_module.language_module": patch_language_module,
        "megatron.core.optimizer.optimizer": patch_optimizer,
        "megatron.core.distributed.distributed_data_parallel": patch_ddp,
        "megatron.core.pipeline_parallel.schedules": patch_schedules,
        "megatron.core.transformer.moe.experts": patch_experts,
        "megatron.core.transformer.moe.token_dispatcher": patch_token_dispatcher,
    },
    versions=tested_range("0.14"),
    default=False,
)
