"""Separate LoRA adapters per projection on Megatron's fused linears (docs/architecture.md section 4).

Megatron fuses q, k, v into `linear_qkv` and SwiGLU's gate, up into `linear_fc1`; standard PEFT
LoRA adapts each projection on its own (its own A and B). With `separate_projections`, the adapter
of such a layer stacks the k projections' A's (`A`: k*r x in) and holds a block `B` (out x k*r):
the output rows of projection j use only columns j*r .. (j+1)*r, so `B_eff = B * mask`. The term
`s * x A^T B_eff^T` is then exactly the k separate LoRA terms in Megatron's packed row layout,
still one down- and one up-projection riding the base layer's own collectives. The mask also zeroes
the off-block grads, so those entries stay exactly zero under Adam and weight decay.
Experts keep one A per layer (transformers stores expert gate/up as one fused parameter).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_lora_patch.lora.adapters import layouts


def projection_rows(module_name: str, config: Any, expert_index: Optional[int]) -> Optional[torch.Tensor]:
    """Per logical output row of a fused linear, the index of its projection (q/k/v: 0/1/2, gate/up:
    0/1) in Megatron's world-size-1 row layout; None for a linear that is not fused (or an expert)."""
    if expert_index is not None or config is None:
        return None
    short = module_name.rsplit(".", 1)[-1]
    if short == "linear_qkv":
        head_dim, heads, groups = config.kv_channels, config.num_attention_heads, config.num_query_groups
        ids = [torch.full((count * head_dim,), index) for index, count in enumerate((heads, groups, groups))]
        return layouts.qkv_separate_to_mixed(*ids, groups, head_dim)
    if short == "linear_fc1" and getattr(config, "gated_linear_unit", False):
        ffn = config.ffn_hidden_size
        return layouts.gate_up_to_fc1(torch.zeros(ffn, dtype=torch.long), torch.ones(ffn, dtype=torch.long))
    return None


def block_mask(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """The logical `out x (k*rank)` 0/1 mask: row i keeps the columns of its projection `rows[i]`."""
    blocks = int(rows.max()) + 1
    columns = torch.arange(blocks * rank) // rank
    return (columns.unsqueeze(0) == rows.unsqueeze(1)).to(torch.float32)


def per_projection(lora_a: torch.Tensor, b_parts: list, description: dict) -> list:
    """(A, B) per PEFT projection of a fused layer's export: each projection's own A rows and B block
    when its adapters are separate, else the one shared A with each projection's rows of B."""
    if description.get("separate_projections") and len(b_parts) > 1:
        return split_blocks(lora_a, b_parts, len(b_parts))
    return [(lora_a, part) for part in b_parts]


def split_blocks(lora_a: torch.Tensor, parts: list, blocks: int) -> list:
    """[(A_j, B_j)] of each projection from the stacked A and the per-projection row blocks of B."""
    rank = lora_a.shape[0] // blocks
    return [(lora_a[j * rank:(j + 1) * rank], part[:, j * rank:(j + 1) * rank]) for j, part in enumerate(parts)]


def join_blocks(a_parts: list, b_parts: list) -> tuple:
    """(stacked A, per-projection B rows padded to k*r block columns): the inverse of `split_blocks`."""
    rank, blocks = a_parts[0].shape[0], len(a_parts)
    padded = []
    for j, part in enumerate(b_parts):
        full = part.new_zeros(part.shape[0], blocks * rank)
        full[:, j * rank:(j + 1) * rank] = part
        padded.append(full)
    return torch.cat(a_parts, dim=0), padded
