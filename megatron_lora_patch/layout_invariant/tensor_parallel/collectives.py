"""The collectives of the TP-invariant mode (docs/architecture.md section 7).

- `tree_all_gather(partials, group)`: finishes the canonical segment tree (`layout_invariant.tensor_parallel.shares`)
  over TP: every rank holds its subtree's partial sums (activation-sized: a row layer's output
  and LoRA hidden, a column layer's input grad and LoRA hidden grad); ONE all-gather of them
  (flattened together) and the tree over the ranks' partials in rank order gives every rank the
  TP = 1 sums, bit for bit. It replaces a reduce, whose order would depend on the TP degree.
- `gather_logical(t, dim, stride, group)`: forward all-gathers the shards of an activation and
  lays them out as the world-size-1 tensor (the vocab-parallel logits, `layout_invariant.tensor_parallel.loss`);
  backward keeps this rank's slice of the (complete) gradient. No reduction: summing the
  identical copies would multiply the grad by the TP size.
- `all_gather_logical(t, dim, stride, group)`: the plain gather.
- `column_share(t, group)`: this rank's share of the last dimension of a tensor every rank holds
  complete, zeros elsewhere, so a SUM over the group that follows assembles it exactly (`x + 0 == x`);
  `share_grad(t, group)` applies it to the gradient (an expert column layer's input grad under
  expert TP, which the token dispatcher's reduce-scatter sums over the ETP ranks).

At world size 1 all are identities (the tensor itself is returned, outside autograd functions,
so later in-place ops on it stay legal). None of them is ever applied to a base weight: no rank
holds a full (unsharded) base weight in this mode.
"""

from __future__ import annotations

from typing import Any, List

import torch
import torch.distributed

from megatron_lora_patch.layout_invariant.tensor_parallel.shares import TreeSum
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


def tree_all_gather(partials: List[torch.Tensor], group: Any) -> List[torch.Tensor]:
    """The canonical tree sums whose subtree of this rank `partials` are (one dtype): one all-gather of
    them all, then the tree over the ranks' partials in rank order, the same on every rank."""
    world, _ = _size_and_rank(group)
    if world == 1:
        return partials
    flat = torch.cat([partial.reshape(-1) for partial in partials])
    pieces = [torch.empty_like(flat) for _ in range(world)]
    torch.distributed.all_gather(pieces, flat, group=group)
    tree = TreeSum()
    for piece in pieces:  # elementwise sums: the flattened buffer runs the tree of every partial at once
        tree.add(piece)
    total = tree.result()
    return [part.view_as(partial) for part, partial in zip(total.split([p.numel() for p in partials]), partials)]


def column_share(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Rank r of n keeps the r-th n-th of the last dimension of `tensor` (complete on every rank),
    zeros elsewhere: the SUM of the ranks' shares is `tensor`, bit for bit."""
    world, rank = _size_and_rank(group)
    if world == 1:
        return tensor
    share = tensor.new_zeros(tensor.shape)
    columns = slice(tensor.shape[-1] * rank // world, tensor.shape[-1] * (rank + 1) // world)
    share[..., columns] = tensor[..., columns]
    return share


class _ShareGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return column_share(grad, ctx.group), None


def share_grad(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity whose backward keeps this rank's `column_share` of the (complete, identical) gradient."""
    if torch.distributed.get_world_size(group) == 1:
        return tensor
    return _ShareGrad.apply(tensor, group)


def _local_shard(tensor: torch.Tensor, dim: int, stride: int, group: Any) -> torch.Tensor:
    world, rank = _size_and_rank(group)
    if world == 1:
        return tensor
    return shard(tensor, dim, rank, world, stride)


class _GatherLogical(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, dim, stride, group):
        ctx.dim, ctx.stride, ctx.group = dim, stride, group
        return all_gather_logical(tensor, dim, stride, group)

    @staticmethod
    def backward(ctx, grad):
        return _local_shard(grad, ctx.dim, ctx.stride, ctx.group), None, None, None


def gather_logical(tensor: torch.Tensor, dim: int, stride: int, group: Any) -> torch.Tensor:
    """All-gather an activation to the world-size-1 layout; backward: this rank's slice of the complete grad."""
    if torch.distributed.get_world_size(group) == 1:
        return tensor
    return _GatherLogical.apply(tensor, dim, stride, group)
