"""SUM the gradients of replicated LoRA factors over their shard domain (docs/architecture.md section 4).

A replicated factor (column A, row B, and their expert twins) holds the same logical
tensor on every rank of its domain (dense TP or expert TP), but each rank only sees the
partial gradient from its own shard of the base layer's input or output. The logical
gradient is the SUM of those partials: never an average, never skipped. Sharded factors
and non-adapter parameters are left to Megatron's own DP / expert-DP sync.

This is plain LoRA math over real process groups; the `finalize_grads` patch runs it
right after Megatron's `finalize_model_grads` (`lora.finalize`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Tuple

import torch
import torch.distributed

from megatron_lora_patch.lora.adapters import metadata
from megatron_lora_patch.lora.adapters.metadata import AdapterParamInfo, adapter_info

log = logging.getLogger(__name__)

#: Grads below fp32 are summed in fp32 (partial sums of bf16 grads lose bits otherwise).
REDUCE_DTYPE = torch.float32

BucketKey = Tuple[Tuple[int, ...], str, torch.dtype, torch.device]  # (domain ranks, op, grad dtype, device)

#: model chunk -> (metadata generation, its replicated adapter factors in model order): one walk over
#: the chunk's parameters per set of adapters, not per step (`metadata.generation` moves on every tag).
_REPLICATED_OF_CHUNK: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()

#: Domains ("tp", "expert_tp") whose replicated factors already hold their complete grad on every rank, so they
#: leave the SUM (which would multiply them by the domain size): the TP-invariant linears compute the LoRA
#: branch at full width on every (expert) TP rank and declare both through `set_complete_domains`.
_complete_domains: frozenset = frozenset()


def set_complete_domains(domains: Iterable[str]) -> frozenset:
    """Declare the domains whose replicated factors need no SUM; returns the previous declaration."""
    global _complete_domains
    previous, _complete_domains = _complete_domains, frozenset(domains)
    return previous


def grad_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient Megatron owns: `main_grad` under Megatron DDP, `.grad` otherwise."""
    if hasattr(param, "main_grad"):
        return param.main_grad
    return param.grad


def _replicated_factors_of(chunk: torch.nn.Module) -> tuple:
    """(param, info) of every replicated adapter factor of `chunk`, cached until adapters are tagged again."""
    cached = _REPLICATED_OF_CHUNK.get(chunk)
    if cached is not None and cached[0] == metadata.generation():
        return cached[1]
    factors = tuple(
        (param, info) for param in chunk.parameters() if (info := adapter_info(param)) is not None and info.replicated
    )
    _REPLICATED_OF_CHUNK[chunk] = (metadata.generation(), factors)
    return factors


def replicated_adapter_params(
    model_chunks: Iterable[torch.nn.Module],
) -> Iterator[Tuple[torch.nn.Parameter, AdapterParamInfo]]:
    """Trainable replicated adapter factors whose domain spans more than one rank, in model order.

    Model order is identical on every rank of a domain (same module structure), which is
    what keeps the per-group collective order identical across ranks (no deadlock).
    """
    seen = set()
    for chunk in model_chunks:
        for param, info in _replicated_factors_of(chunk):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if getattr(param, "sequence_parallel", False) or getattr(
                param, "average_gradients_across_tp_domain", False
            ):
                # Megatron's finalize already all-reduces such grads over TP: a second SUM would double them.
                raise ValueError(
                    f"replicated LoRA factor {info.module}.{info.factor} also carries `sequence_parallel` or "
                    "`average_gradients_across_tp_domain`, so Megatron's finalize_model_grads reduces it over TP "
                    "and the adapter SUM would count it twice; tag replicated adapter factors with the adapter "
                    "metadata only (megatron_lora_patch.lora.adapters.metadata.tag)"
                )
            if info.group is None or torch.distributed.get_world_size(info.group) == 1:
                continue
            if info.domain not in _complete_domains:
                yield param, info


def bucket_replicated_adapter_grads(
    model_chunks: Iterable[torch.nn.Module],
) -> Dict[BucketKey, Tuple[Any, List[torch.Tensor]]]:
    """(group, grads) to SUM, keyed by (domain ranks, op, dtype, device) in first-seen order.

    Keyed by the ranks, not the group object: expert TP and dense TP are distinct groups over
    the same ranks when ETP == TP (and EP == 1), and one all-reduce serves both. The first
    group seen for a key carries it (model order, so the same one on every rank).
    """
    buckets: Dict[BucketKey, Tuple[Any, List[torch.Tensor]]] = {}
    ranks_of: Dict[int, Tuple[int, ...]] = {}
    for param, info in replicated_adapter_params(model_chunks):
        grad = grad_of(param)
        if grad is None:  # like Megatron's finalize: a param without a grad on this step is skipped
            continue
        ranks = ranks_of.get(id(info.group))
        if ranks is None:
            ranks = ranks_of[id(info.group)] = tuple(torch.distributed.get_process_group_ranks(info.group))
        key = (ranks, info.grad_sync_op, grad.dtype, grad.device)
        buckets.setdefault(key, (info.group, []))[1].append(grad)
    return buckets


def sum_replicated_adapter_grads(model_chunks: Iterable[torch.nn.Module]) -> int:
    """SUM every replicated adapter factor's grad over its domain, in place; returns the collectives issued.

    One coalesced all-reduce per (domain ranks, op, dtype, device) bucket, the way
    Megatron's finalize reduces its own layernorm grads. Must run on every rank of each
    domain at the same point of the step.
    """
    buckets = bucket_replicated_adapter_grads(model_chunks)
    for (ranks, op, dtype, _device), (group, grads) in buckets.items():
        if op != "sum":
            raise ValueError(f"unsupported adapter grad_sync_op {op!r}; replicated factors are SUMmed")
        _all_reduce_sum(grads, group, dtype)
        log.debug("summed %d replicated adapter grads (%s) over a group of %d ranks", len(grads), dtype, len(ranks))
    return len(buckets)


@torch.no_grad()
def _all_reduce_sum(grads: List[torch.Tensor], group: Any, dtype: torch.dtype) -> None:
    """SUM `grads` over `group` in place with one all-reduce: a lone contiguous grad in its own
    dtype is reduced where it lies; otherwise each grad is copied (cast) into one flat buffer in
    the reduce dtype and back, one copy each way."""
    reduce_dtype = REDUCE_DTYPE if dtype.is_floating_point and dtype.itemsize < REDUCE_DTYPE.itemsize else dtype
    if len(grads) == 1 and reduce_dtype == dtype and grads[0].is_contiguous():
        torch.distributed.all_reduce(grads[0], op=torch.distributed.ReduceOp.SUM, group=group)
        return
    sizes = [grad.numel() for grad in grads]
    flat = torch.empty(sum(sizes), dtype=reduce_dtype, device=grads[0].device)
    slots = [slot.view(grad.shape) for slot, grad in zip(flat.split(sizes), grads)]
    for slot, grad in zip(slots, grads):
        slot.copy_(grad)
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM, group=group)
    for slot, grad in zip(slots, grads):
        grad.copy_(slot)
