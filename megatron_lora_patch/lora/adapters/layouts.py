"""Where each row/column of a logical LoRA factor lives: TP shards, mixed QKV, SwiGLU fc1.

The logical adapter is the world-size-1 one, in Megatron's own world-size-1 layout:
- `linear_qkv` output rows are packed per query group as `[q heads of the group, k, v]`
  (GQA: `num_heads / num_query_groups` q heads per group). Query groups are split
  over TP contiguously, so a TP shard of qkv B is a plain contiguous slice.
- gated (SwiGLU) `linear_fc1` output rows are `[gate; up]` at world size 1, but every
  TP shard holds `[gate_shard; up_shard]`: the shard is Megatron's stride-2 split
  (`_initialize_affine_weight_cpu` with stride 2), not a contiguous slice.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


def shard(tensor: torch.Tensor, dim: int, rank: int, world: int, stride: int = 1) -> torch.Tensor:
    """Rank `rank`'s slice of `tensor` along `dim`, split Megatron's way for `stride`.

    The dimension is cut into `world * stride` equal chunks; rank r takes chunks
    r, r + world, ... (stride 1: one contiguous slice; stride 2: `[gate_r; up_r]`).
    """
    size = tensor.shape[dim]
    if size % (world * stride):
        raise ValueError(f"dimension {dim} of size {size} does not split into {world} x {stride} chunks")
    chunks = torch.split(tensor, size // (world * stride), dim=dim)
    return torch.cat(chunks[rank::world], dim=dim).contiguous()


def unshard(shards: Sequence[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The logical tensor whose `shard(..., rank=r, world=len(shards), stride)` is `shards[r]`."""
    world = len(shards)
    pieces: List[List[torch.Tensor]] = [list(torch.chunk(part, stride, dim=dim)) for part in shards]
    ordered = [pieces[rank][chunk] for chunk in range(stride) for rank in range(world)]
    return torch.cat(ordered, dim=dim)


def _check_groups(num_heads: int, num_query_groups: int) -> int:
    if num_heads % num_query_groups:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_query_groups {num_query_groups}")
    return num_heads // num_query_groups


def qkv_mixed_to_separate(
    mixed: torch.Tensor, num_heads: int, num_query_groups: int, head_dim: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split rows of Megatron's mixed qkv layout into `(q, k, v)`, each in head order.

    `mixed` has `(num_heads + 2 * num_query_groups) * head_dim` rows (any trailing dims);
    q gets `num_heads * head_dim` rows, k and v `num_query_groups * head_dim` each.
    """
    heads_per_group = _check_groups(num_heads, num_query_groups)
    rest = mixed.shape[1:]
    grouped = mixed.reshape(num_query_groups, (heads_per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(num_heads * head_dim, *rest),
        k.reshape(num_query_groups * head_dim, *rest),
        v.reshape(num_query_groups * head_dim, *rest),
    )


def qkv_separate_to_mixed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int, head_dim: int
) -> torch.Tensor:
    """Pack `(q, k, v)` rows into Megatron's mixed per-query-group layout (inverse of the split)."""
    num_heads = q.shape[0] // head_dim
    heads_per_group = _check_groups(num_heads, num_query_groups)
    rest = q.shape[1:]
    grouped = torch.cat(
        [
            q.reshape(num_query_groups, heads_per_group * head_dim, *rest),
            k.reshape(num_query_groups, head_dim, *rest),
            v.reshape(num_query_groups, head_dim, *rest),
        ],
        dim=1,
    )
    return grouped.reshape((num_heads + 2 * num_query_groups) * head_dim, *rest)


def gate_up_to_fc1(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """World-size-1 SwiGLU fc1 rows `[gate; up]` (shard it with `shard(..., stride=2)`)."""
    return torch.cat([gate, up], dim=0)


def fc1_to_gate_up(fc1: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split world-size-1 SwiGLU fc1 rows into `(gate, up)`."""
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate, up
