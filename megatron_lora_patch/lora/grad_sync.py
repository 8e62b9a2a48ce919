"""SUM the gradients of replicated LoRA factors over their shard domain (DESIGN.md section 4).

A replicated factor (column A, row B, and their expert twins) holds the same logical
tensor on every rank of its domain (dense TP or expert TP), but each rank only sees the
partial gradient from its own shard of the base layer's input or output. The logical
gradient is the SUM of those partials: never an average, never skipped. Sharded factors
and non-adapter parameters are left to Megatron's own DP / expert-DP sync.

This is plain LoRA math over real process groups; the `finalize_grads` patch runs it
right after Megatron's `finalize_model_grads`.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, Iterator, List, Tuple

import torch
import torch.distributed
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron_lora_patch.lora.metadata import AdapterParamInfo, adapter_info

log = logging.getLogger(__name__)

#: Grads below fp32 are summed in fp32 (partial sums of bf16 grads lose bits otherwise).
REDUCE_DTYPE = torch.float32

BucketKey = Tuple[Any, str, torch.dtype, torch.device]  # (domain group, op, grad dtype, device)


def grad_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient Megatron owns: `main_grad` under Megatron DDP, `.grad` otherwise."""
    if hasattr(param, "main_grad"):
        return param.main_grad
    return param.grad


def replicated_adapter_params(model_chunks: Iterable[torch.nn.Module]) -> Iterator[Tuple[torch.nn.Parameter, AdapterParamInfo]]:
    """Trainable replicated adapter factors whose domain spans more than one rank, in model order.

    Model order is identical on every rank of a domain (same module structure), which is
    what keeps the per-group collective order identical across ranks (no deadlock).
    """
    seen = set()
    for chunk in model_chunks:
        for param in chunk.parameters():
            info = adapter_info(param)
            if info is None or not info.replicated or not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if getattr(param, "sequence_parallel", False) or getattr(param, "average_gradients_across_tp_domain", False):
                # Megatron's finalize already all-reduces such grads over TP: a second SUM would double them.
                raise ValueError(
                    f"replicated LoRA factor {info.module}.{info.factor} also carries `sequence_parallel` or "
                    "`average_gradients_across_tp_domain`, so Megatron's finalize_model_grads reduces it over TP "
                    "and the adapter SUM would count it twice; tag replicated adapter factors with the adapter "
                    "metadata only (megatron_lora_patch.lora.metadata.tag)"
                )
            if info.group is None or torch.distributed.get_world_size(info.group) == 1:
                continue
            yield param, info


def bucket_replicated_adapter_grads(model_chunks: Iterable[torch.nn.Module]) -> Dict[BucketKey, List[torch.Tensor]]:
    """The grads to SUM, grouped by (domain group, op, dtype, device) in first-seen order."""
    buckets: Dict[BucketKey, List[torch.Tensor]] = {}
    for param, info in replicated_adapter_params(model_chunks):
        grad = grad_of(param)
        if grad is None:  # like Megatron's finalize: a param without a grad on this step is skipped
            continue
        key = (info.group, info.grad_sync_op, grad.dtype, grad.device)
        buckets.setdefault(key, []).append(grad)
    return buckets


def sum_replicated_adapter_grads(model_chunks: Iterable[torch.nn.Module]) -> int:
    """SUM every replicated adapter factor's grad over its domain, in place; returns the collectives issued.

    One coalesced all-reduce per (domain group, op, dtype, device) bucket, the way
    Megatron's finalize reduces its own layernorm grads (`_flatten_dense_tensors`).
    Must run on every rank of each domain at the same point of the step.
    """
    buckets = bucket_replicated_adapter_grads(model_chunks)
    for (group, op, dtype, _device), grads in buckets.items():
        if op != "sum":
            raise ValueError(f"unsupported adapter grad_sync_op {op!r}; replicated factors are SUMmed")
        coalesced = _flatten_dense_tensors([grad.data for grad in grads])
        if dtype.is_floating_point and dtype.itemsize < REDUCE_DTYPE.itemsize:
            coalesced = coalesced.to(REDUCE_DTYPE)
        torch.distributed.all_reduce(coalesced, op=torch.distributed.ReduceOp.SUM, group=group)
        for grad, synced in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
            grad.data.copy_(synced)
        log.debug("summed %d replicated adapter grads (%s) over a group of %d ranks",
                  len(grads), dtype, torch.distributed.get_world_size(group))
    return len(buckets)
