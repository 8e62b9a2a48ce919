"""The optimizer's grad norm over the logical (world-size-1) gradients, in float64.

Megatron sums squares per rank over the local shards and all-reduces the partial sums
over the model-parallel group, so the norm (and the clip coefficient derived from it)
depends on how TP cut the tensors. Here every rank all-gathers each TP-sharded grad into
its world-size-1 layout, squares and sums it in float64, and adds the per-parameter sums
in model order: the same operations on the same tensors at every TP degree, so the norm
is bitwise identical and Megatron's own clipping (`max_norm / (norm + 1e-6)`, one scalar
multiply per element) stays identical too. That exactness is why the coefficient needs
no power-of-two rounding here (#4740 rounds it to absorb a 1-ULP jitter of per-rank sums).

Cost: one all-gather per sharded trainable parameter per step (for LoRA: the sharded
factor grads only). Supported: one pipeline stage, the non-distributed optimizer, no
experts; the functions raise otherwise.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from megatron_lora_patch import registry
from megatron_lora_patch.tp_invariant.collectives import all_gather_logical
from megatron_lora_patch.lora.metadata import adapter_info
from megatron_lora_patch.tp_invariant import TPInvariantUnsupported

log = logging.getLogger(__name__)


def _check_supported(optimizer: Any) -> None:
    from megatron.core import parallel_state

    config = optimizer.config
    if getattr(config, "use_distributed_optimizer", False):
        raise TPInvariantUnsupported(
            "tp_invariant: the distributed optimizer shards grads over data parallel; use "
            "use_distributed_optimizer=False with the TP-invariant mode"
        )
    if getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        raise TPInvariantUnsupported("tp_invariant: the precision-aware optimizer (decoupled grads) is not supported")
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise TPInvariantUnsupported("tp_invariant: pipeline parallelism is not supported (pp must be 1)")


def _tp_group(param: Any) -> Any:
    from megatron.core import parallel_state

    info = adapter_info(param)
    return info.group if info is not None else parallel_state.get_tensor_model_parallel_group()


def _logical_grad(param: Any, grad: torch.Tensor) -> torch.Tensor:
    if not getattr(param, "allreduce", True):
        raise TPInvariantUnsupported("tp_invariant: expert parameters (MoE) are not supported")
    if not getattr(param, "tensor_model_parallel", False):
        group = _tp_group(param)
        if getattr(param, "sequence_parallel", False) and torch.distributed.get_world_size(group) > 1:
            registry.warn_once(
                "tp-invariant-sp-norm",
                "tp_invariant: a trainable norm weight under sequence parallelism gets its grad from per-rank "
                "partial sums, which is not TP-invariant (LoRA freezes norms; full training under SP is not covered)",
            )
        return grad
    return all_gather_logical(grad, param.partition_dim, getattr(param, "partition_stride", 1), _tp_group(param))


@torch.no_grad()
def logical_grad_norm(optimizers: Iterable[Any]) -> float:
    """L2 norm of every (not shared) parameter's logical grad, accumulated in float64 in model order."""
    total = None
    for optimizer in optimizers:
        _check_supported(optimizer)
        for param in optimizer.get_parameters():
            if param.grad is None or getattr(param, "shared", False):
                continue
            square_sum = _logical_grad(param, param.grad).double().square().sum()
            total = square_sum if total is None else total + square_sum
    return 0.0 if total is None else float(total.sqrt())


def get_grad_norm(wrapped, instance, args, kwargs):
    """wrapt wrapper of `MegatronOptimizer.get_grad_norm()`."""
    return logical_grad_norm([instance])


def chained_get_grad_norm(wrapped, instance, args, kwargs):
    """wrapt wrapper of `ChainedOptimizer.get_grad_norm()`: one norm over all its optimizers."""
    return logical_grad_norm(instance.chained_optimizers)


def clip_grad_norm(wrapped, instance, args, kwargs):
    """wrapt wrapper of `MegatronOptimizer.clip_grad_norm(clip_grad)`: logical norm, Megatron's clipping."""
    from megatron.core.optimizer import optimizer as optimizer_module

    clip_grad = _clip_argument(*args, **kwargs)
    grad_norm = logical_grad_norm([instance])
    params = instance.get_parameters()
    if params:
        optimizer_module.clip_grad_by_total_norm_fp32(params, clip_grad, grad_norm)
    return grad_norm


def _clip_argument(clip_grad: float) -> float:
    return clip_grad
