"""The router probabilities inside a layout-invariant expert, with a canonical grad under expert TP
(docs/architecture.md section 7).

Megatron's expert MLP multiplies its activation by the token's router probability
(`act * probs`) before `linear_fc2`; the probability's grad is the sum over the FFN columns of
`dAct * act`. Under expert TP each ETP rank holds a shard of those columns, so each computes a
partial sum and the dispatcher's reduce-scatter over the ETP group adds the partials: an order,
and partial widths, that change with etp. Here the MLP is handed ones (`act * 1 == act`, and its
input grad `g * 1 == g`), and a pre-hook on `linear_fc2` applies the probabilities with
`_ScaleRows`: forward `(act * probs).to(act.dtype)` as Megatron does; backward the same input grad
and the probability grad as `segmented.row_sums` (chunk sums per segment, the segment tree, one
all-gather over the ETP group), which ETP rank 0 returns and the other ranks return as zeros, so
the dispatcher's SUM over the ETP group assembles it exactly (`p + 0 == p`). At etp = 1 the same
code runs without the collective: every layout forms the same bits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed

from megatron_lora_patch.layout_invariant.tensor_parallel.segmented import row_sums


class _ScaleRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, act, probs, group):
        ctx.save_for_backward(act, probs)
        ctx.group = group
        return (act * probs.unsqueeze(-1)).to(act.dtype)

    @staticmethod
    def backward(ctx, grad):
        act, probs = ctx.saved_tensors
        wide = grad.to(torch.promote_types(act.dtype, probs.dtype))  # autograd's order: the cast, then the product
        grad_act = (wide * probs.unsqueeze(-1)).to(act.dtype)
        grad_probs = row_sums(wide * act, ctx.group).to(probs.dtype)
        if torch.distributed.get_rank(ctx.group) != 0:
            grad_probs = torch.zeros_like(grad_probs)
        return grad_act, grad_probs, None


def scaled_expert(expert: Any, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """`expert(tokens, probs)[0]` (2-D tokens, 1-D probs), the probabilities applied by `_ScaleRows` on the
    input of `linear_fc2`."""
    group = expert.linear_fc2.tp_group

    def scale_input(module, args):
        return (_ScaleRows.apply(args[0], probs, group),) + tuple(args[1:])

    hook = expert.linear_fc2.register_forward_pre_hook(scale_input)
    try:
        return expert(tokens, torch.ones_like(probs))[0]
    finally:
        hook.remove()
