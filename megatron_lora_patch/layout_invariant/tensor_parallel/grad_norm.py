"""The optimizer's grad norm over the logical (world-size-1) gradients, in float64
(docs/architecture.md section 7).

Megatron sums squares per rank over the local shards and all-reduces the partial sums
over the model-parallel group, so the norm (and the clip coefficient derived from it)
depends on how TP cut the tensors and how PP split the layers. Here every rank all-gathers
each TP-sharded grad into its world-size-1 layout and squares and sums it in float64 (one
value per parameter, the same operations on the same tensor at every layout); the
per-parameter values of all pipeline stages are all-gathered over the PP group and added
with `math.fsum`, which rounds the exact sum once and so does not depend on their order
(parameter groups and stages order them differently per layout). The norm is bitwise
identical and Megatron's own clipping (`max_norm / (norm + 1e-6)`, one scalar multiply per
element) stays identical too. That exactness is why the coefficient needs no power-of-two
rounding here (#4740 rounds it to absorb a 1-ULP jitter of per-rank sums). Data-parallel
ranks hold identical grads in the layout-invariant mode, so they need no reduction; under
the distributed optimizer the norm reads the model params' full `main_grad` (the
layout-invariant combine leaves the whole grad buffer reduced on every rank).

Cost: ONE all-gather per (TP group, dtype) per step, of every sharded trainable grad
flattened into one buffer (for LoRA: the sharded factor grads only). Summing per-rank
float64 partial sums instead (one scalar all-reduce) is not bitwise: it changes the
float64 summation order with the TP degree (measured: it differs from the TP = 1 norm in
the last bits); plus, under PP, one all-gather of one float64 per parameter, and under EP one
of one float64 per expert parameter (each EP rank holds other experts). Not supported (the
functions raise): the precision-aware optimizer.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, Iterable, List

import torch

from megatron_lora_patch.layout_invariant.tensor_parallel import TPInvariantUnsupported
from megatron_lora_patch.lora.adapters.layouts import unshard
from megatron_lora_patch.lora.adapters.metadata import adapter_info
from megatron_lora_patch.runtime import registry

log = logging.getLogger(__name__)


def _check_supported(optimizer: Any) -> None:
    if getattr(optimizer.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        raise TPInvariantUnsupported("tp_invariant: the precision-aware optimizer (decoupled grads) is not supported")


def _tp_group(param: Any) -> Any:
    from megatron.core import parallel_state

    info = adapter_info(param)
    return info.group if info is not None else parallel_state.get_tensor_model_parallel_group()


def _check_param(param: Any) -> None:
    if getattr(param, "tensor_model_parallel", False) or not getattr(param, "sequence_parallel", False):
        return
    if torch.distributed.get_world_size(_tp_group(param)) > 1:
        registry.warn_once(
            "tp-invariant-sp-norm",
            "tp_invariant: a trainable norm weight under sequence parallelism gets its grad from per-rank "
            "partial sums, which is not TP-invariant (LoRA freezes norms; full training under SP is not covered)",
        )


def _gather_flat(params: List[Any], grads: List[torch.Tensor], group: Any) -> List[torch.Tensor]:
    """The logical grads of `params` (one TP group, one dtype) from ONE all-gather of their
    flattened shards `grads`; each is then laid out exactly as a per-tensor gather would lay it out."""
    world = torch.distributed.get_world_size(group)
    if world == 1:
        return grads
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    pieces = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(pieces, flat, group=group)
    per_rank = [piece.split([grad.numel() for grad in grads]) for piece in pieces]
    return [
        unshard([chunks[index].view_as(grad) for chunks in per_rank], param.partition_dim,
                getattr(param, "partition_stride", 1))
        for index, (param, grad) in enumerate(zip(params, grads))
    ]


def _logical_grads(normed: List[tuple]) -> List[torch.Tensor]:
    """The logical grad of every `(param, grad)`: TP-sharded ones from one all-gather per (TP group, dtype)."""
    buckets: Dict[tuple, List[int]] = {}
    for index, (param, grad) in enumerate(normed):
        if getattr(param, "tensor_model_parallel", False):
            buckets.setdefault((_tp_group(param), grad.dtype), []).append(index)
    logical = [grad for _, grad in normed]
    for (group, _), members in buckets.items():
        gathered = _gather_flat([normed[i][0] for i in members], [normed[i][1] for i in members], group)
        for index, grad in zip(members, gathered):
            logical[index] = grad
    return logical


def _optimizer_grads(optimizer: Any) -> List[tuple]:
    """(param, grad) the optimizer steps on: its own params, or under the distributed optimizer (whose
    params are this DP rank's shards) every trainable model param with its full `main_grad`."""
    _check_supported(optimizer)
    if getattr(optimizer.config, "use_distributed_optimizer", False):
        return [(param, param.main_grad) for chunk in optimizer.model_chunks for param in chunk.parameters()
                if param.requires_grad and not getattr(param, "shared", False)]
    return [(param, param.grad) for param in optimizer.get_parameters()
            if param.grad is not None and not getattr(param, "shared", False)]


def _pipeline_fsum(values: List[torch.Tensor]) -> float:
    """`math.fsum` of this rank's float64 `values` and those of every other pipeline stage."""
    from megatron.core import parallel_state

    local = torch.stack(values) if values else torch.zeros(0, dtype=torch.float64)
    group = parallel_state.get_pipeline_model_parallel_group()
    if torch.distributed.get_world_size(group) > 1:
        counts = [torch.zeros(1, dtype=torch.long) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(counts, torch.tensor([local.numel()]), group=group)
        longest = max(int(count) for count in counts)
        pieces = [torch.zeros(longest, dtype=torch.float64) for _ in counts]
        padded = torch.cat([local, local.new_zeros(longest - local.numel())])
        torch.distributed.all_gather(pieces, padded, group=group)
        local = torch.cat([piece[: int(count)] for piece, count in zip(pieces, counts)])
    return math.fsum(local.tolist())


@torch.no_grad()
def logical_grad_norm(optimizers: Iterable[Any]) -> float:
    """L2 norm of every (not shared) parameter's logical grad: float64 square sums per parameter,
    added exactly (`math.fsum`) over all of them and all pipeline stages. Each parameter counts
    once, also where chained distributed optimizers share the model chunks."""
    normed = list({id(pair[0]): pair for optimizer in optimizers for pair in _optimizer_grads(optimizer)}.values())
    for param, _ in normed:
        _check_param(param)
    squares = [grad.double().square().sum() for grad in _logical_grads(normed)]
    dense = [value for (param, _), value in zip(normed, squares) if getattr(param, "allreduce", True)]
    experts = [value for (param, _), value in zip(normed, squares) if not getattr(param, "allreduce", True)]
    return math.sqrt(_pipeline_fsum(dense + _expert_parallel_values(experts)))


def _expert_parallel_values(values: List[torch.Tensor]) -> List[torch.Tensor]:
    """The float64 values of this rank's expert-parallel parameters and those of the other EP ranks
    (each holds other experts; every EP rank has the same number of expert parameters)."""
    from megatron.core import parallel_state

    group = parallel_state.get_expert_model_parallel_group()
    if not values or torch.distributed.get_world_size(group) == 1:
        return values
    local = torch.stack(values)
    pieces = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(pieces, local, group=group)
    return list(torch.cat(pieces))


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
