"""The optimizer's grad norm over the logical (world-size-1) gradients, in float64.

Megatron sums squares per rank over the local shards and all-reduces the partial sums
over the model-parallel group, so the norm (and the clip coefficient derived from it)
depends on how TP cut the tensors. Here every rank all-gathers each TP-sharded grad into
its world-size-1 layout, squares and sums it in float64, and adds the per-parameter sums
in model order: the same operations on the same tensors at every TP degree, so the norm
is bitwise identical and Megatron's own clipping (`max_norm / (norm + 1e-6)`, one scalar
multiply per element) stays identical too. That exactness is why the coefficient needs
no power-of-two rounding here (#4740 rounds it to absorb a 1-ULP jitter of per-rank sums).

Cost: ONE all-gather per (TP group, dtype) per step, of every sharded trainable grad
flattened into one buffer (for LoRA: the sharded factor grads only). Summing per-rank
float64 partial sums instead (one scalar all-reduce) is not bitwise: it changes the
float64 summation order with the TP degree (measured: it differs from the TP = 1 norm in
the last bits). Supported: one pipeline stage, the non-distributed optimizer, no experts;
the functions raise otherwise.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List

import torch

from megatron_lora_patch.lora.adapters.layouts import unshard
from megatron_lora_patch.lora.adapters.metadata import adapter_info
from megatron_lora_patch.runtime import registry
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


def _check_param(param: Any) -> None:
    if not getattr(param, "allreduce", True):
        raise TPInvariantUnsupported("tp_invariant: expert parameters (MoE) are not supported")
    if getattr(param, "tensor_model_parallel", False) or not getattr(param, "sequence_parallel", False):
        return
    if torch.distributed.get_world_size(_tp_group(param)) > 1:
        registry.warn_once(
            "tp-invariant-sp-norm",
            "tp_invariant: a trainable norm weight under sequence parallelism gets its grad from per-rank "
            "partial sums, which is not TP-invariant (LoRA freezes norms; full training under SP is not covered)",
        )


def _gather_flat(params: List[Any], group: Any) -> List[torch.Tensor]:
    """The logical grads of `params` (one TP group, one dtype) from ONE all-gather of their
    flattened shards; each is then laid out exactly as a per-tensor gather would lay it out."""
    world = torch.distributed.get_world_size(group)
    if world == 1:
        return [param.grad for param in params]
    flat = torch.cat([param.grad.reshape(-1) for param in params])
    pieces = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(pieces, flat, group=group)
    per_rank = [piece.split([param.grad.numel() for param in params]) for piece in pieces]
    return [
        unshard([chunks[index].view_as(param.grad) for chunks in per_rank], param.partition_dim,
                getattr(param, "partition_stride", 1))
        for index, param in enumerate(params)
    ]


def _logical_sharded_grads(params: List[Any]) -> Dict[int, torch.Tensor]:
    """id(param) -> logical grad of every TP-sharded param, one all-gather per (TP group, dtype)."""
    buckets: Dict[tuple, List[Any]] = {}
    for param in params:
        if getattr(param, "tensor_model_parallel", False):
            buckets.setdefault((_tp_group(param), param.grad.dtype), []).append(param)
    logical: Dict[int, torch.Tensor] = {}
    for (group, _), members in buckets.items():
        logical.update(zip(map(id, members), _gather_flat(members, group)))
    return logical


def _normed_params(optimizers: Iterable[Any]) -> List[Any]:
    params = []
    for optimizer in optimizers:
        _check_supported(optimizer)
        params += [param for param in optimizer.get_parameters()
                   if param.grad is not None and not getattr(param, "shared", False)]
    for param in params:
        _check_param(param)
    return params


@torch.no_grad()
def logical_grad_norm(optimizers: Iterable[Any]) -> float:
    """L2 norm of every (not shared) parameter's logical grad, accumulated in float64 in model order."""
    params = _normed_params(optimizers)
    logical = _logical_sharded_grads(params)
    total = None
    for param in params:
        square_sum = logical.get(id(param), param.grad).double().square().sum()
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
