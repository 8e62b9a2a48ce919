"""Full (world-size-1) weights of the TP-invariant linears, gathered once and reused
(docs/architecture.md section 7).

Every TP-invariant GEMM needs the full weight, bias and LoRA factor on every rank. Gathering
them on every forward call (and again in activation recompute) cost one all-gather and one
concatenation per tensor per call; here each is gathered once and kept while its shards
stay the same:

- a frozen tensor (the base weight and bias) is re-gathered only when its local shard
  changes: the key is the shard's storage pointer and autograd version counter, which every
  tracked in-place write bumps (`copy_` of `load_state_dict`, Megatron's checkpoint load,
  `merge_adapters`) and a `param.data = ...` swap changes;
- a trainable tensor (the LoRA factors; the base in full training) is re-gathered once per
  optimizer step as well: the key also holds a step counter that the `tp_invariant` patch
  advances after every `step_with_ready_grads`, because the mixed-precision optimizer writes
  the model params through `.data`, which no version counter sees.

The cached value enters autograd through `gather_logical(..., full=cached)`, so the grad of a
trainable tensor is its slice of the complete grad, exactly as with a fresh gather, and
recompute under activation checkpointing reuses it. Writes through `.data` to a frozen
weight between steps are not seen: call `clear()` after such a write. Every rank must change
its shards together (as SPMD training does), since a re-gather is a collective.

Memory: the full copies stay resident: every rank holds each gathered tensor at its logical
size, TP times its shard, on top of the shard (benchmarks/README.md states it per model).
Before, each forward call made the same full copies and kept them for its backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed
from torch.utils.weak import WeakTensorKeyDictionary

from megatron_lora_patch.tp_invariant.collectives import all_gather_logical, gather_logical

_FULL = WeakTensorKeyDictionary()
_step = 0


def advance_step() -> None:
    """The optimizer updated the params: trainable tensors are gathered again on next use."""
    global _step
    _step += 1


def clear() -> None:
    """Forget every gathered tensor (on revert, or after writes through `.data`)."""
    _FULL.clear()


def _key(tensor: torch.Tensor, layout: tuple) -> tuple:
    step = _step if tensor.requires_grad else None
    return tensor.data_ptr(), tensor._version, tensor.shape, tensor.dtype, layout, step


def cached_gather(tensor: torch.Tensor, dim: int, stride: int, group: Any) -> torch.Tensor:
    """`gather_logical(tensor, dim, stride, group)`, all-gathering only when the shards changed."""
    if torch.distributed.get_world_size(group) == 1:
        return tensor
    key = _key(tensor, (dim, stride, id(group)))
    entry = _FULL.get(tensor)
    if entry is None or entry[0] != key:
        with torch.no_grad():
            entry = (key, all_gather_logical(tensor.detach(), dim, stride, group))
        _FULL[tensor] = entry
    return gather_logical(tensor, dim, stride, group, full=entry[1])


def optimizer_stepped(wrapped, instance, args, kwargs):
    """wrapt wrapper of `step_with_ready_grads`: advance the step after the params changed."""
    try:
        return wrapped(*args, **kwargs)
    finally:
        advance_step()


def cached_bytes() -> int:
    """Bytes held by the gathered full tensors on this rank (the mode's resident weight memory)."""
    return sum(full.nbytes for _, full in _FULL.values())
