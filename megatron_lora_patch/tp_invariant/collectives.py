"""The collectives of the TP-invariant mode.

In this mode every rank holds the world-size-1 value of every tensor that a TP reduction
would otherwise produce from partial sums (computed whole, or assembled exactly from
shares: `tp_invariant.shares`). Consequently the gradient of such a tensor is complete
and identical on every rank, which fixes the backward of each collective:

- `gather_logical(t, dim, stride, group, full=None)`: forward all-gathers the shards and lays
  them out as the world-size-1 tensor (`stride=2`: a SwiGLU fc1 whose shards are
  `[gate_r; up_r]`), or returns `full`, that tensor gathered earlier (`tp_invariant.cache`);
  backward keeps this rank's slice of the (complete) gradient. No reduction: summing the
  identical copies would multiply the grad by the TP size.
- `all_gather_logical(t, dim, stride, group)`: the plain gather, also used on the column
  output grad (`tp_invariant.shares`), whose backward needs the complete grad.

At world size 1 both are identities (the tensor itself is returned, outside autograd
functions, so later in-place ops on it stay legal).
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed

from megatron_lora_patch.lora.adapters.layouts import shard, unshard


def _size_and_rank(group: Any) -> tuple:
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def all_gather_logical(tensor: torch.Tensor, dim: int, stride: int, group: Any) -> torch.Tensor:
    """The world-size-1 tensor whose TP shards (Megatron's `stride` split along `dim`) the ranks hold."""
    world, _ = _size_and_rank(group)
    if world == 1:
        return tensor
    pieces: List[torch.Tensor] = [torch.empty_like(tensor) for _ in range(world)]
    torch.distributed.all_gather(pieces, tensor.contiguous(), group=group)
    return unshard(pieces, dim, stride)


def _local_shard(tensor: torch.Tensor, dim: int, stride: int, group: Any) -> torch.Tensor:
    world, rank = _size_and_rank(group)
    if world == 1:
        return tensor
    return shard(tensor, dim, rank, world, stride)


class _GatherLogical(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, stride, group, full):
        ctx.dim, ctx.stride, ctx.group = dim, stride, group
        # A cached `full` is handed out as a new tensor object (same storage), so this node's
        # grad_fn is set on the alias, never on the cached tensor.
        return all_gather_logical(tensor, dim, stride, group) if full is None else full.detach()

    @staticmethod
    def backward(ctx, grad):
        return _local_shard(grad, ctx.dim, ctx.stride, ctx.group), None, None, None, None


def gather_logical(tensor: torch.Tensor, dim: int, stride: int, group: Any,
                   full: Optional[torch.Tensor] = None) -> torch.Tensor:
    """All-gather to the world-size-1 layout (or `full`, gathered before from the same shards);
    backward: this rank's slice of the complete grad."""
    if torch.distributed.get_world_size(group) == 1:
        return tensor
    return _GatherLogical.apply(tensor, dim, stride, group, full)
