"""The RoPE key's input grad of multi-latent attention (MLA) under tensor parallelism, local spec.

Megatron's local spec builds `linear_kv_down_proj` column-parallel: each TP rank computes a slice of
`[kv_latent | k_pos_emb]` and `gather_from_tensor_model_parallel_region` joins them; its backward keeps
only the rank's own slice of the grad, which is right only when every rank holds the same full grad.
For the latent it does (its consumer, the column-parallel `linear_kv_up_proj`, all-reduces its input
grad over TP). For the shared RoPE key `k_pos_emb` it does not: each rank expands it over its own heads
only, so its grad is a partial sum over TP that nothing reduces; every rank then back-propagates a
different, incomplete grad into `linear_kv_down_proj` and everything before it (adapters included).
Measured with the oracle on Megatron-Core 0.19: TP2 grads 0.36 relative L2 from world size 1 without
this fix, 1.4e-6 with it.

The fix: while `MLASelfAttention.get_query_key_value_tensors` runs, the gather of the kv down
projection (the one of width `kv_lora_rank + qk_pos_emb_head_dim`; the query latent's, when of the
same width, is the call's first gather) gets a backward that all-reduces the `k_pos_emb` columns of
its grad over TP (a SUM; forward unchanged). The Transformer Engine spec's duplicated down
projections never take that gather (not verified there: TE needs CUDA).
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

_call: contextvars.ContextVar = contextvars.ContextVar("megatron_lora_mla_call", default=None)


class _SumRopeKeyGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces (SUM) the grad's last `rope_dim` columns over `group`."""

    @staticmethod
    def forward(ctx, kv_combined: torch.Tensor, rope_dim: int, group: Any) -> torch.Tensor:
        ctx.rope_dim, ctx.group = rope_dim, group
        return kv_combined.view_as(kv_combined)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        rope = grad[..., -ctx.rope_dim :].contiguous()
        torch.distributed.all_reduce(rope, group=ctx.group)
        grad[..., -ctx.rope_dim :] = rope
        return grad, None, None


def query_key_value(wrapped, instance, args, kwargs):
    """wrapt wrapper of `MLASelfAttention.get_query_key_value_tensors`: marks the call for the gather."""
    token = _call.set({"attention": instance, "gathers": 0})
    try:
        return wrapped(*args, **kwargs)
    finally:
        _call.reset(token)


def gather(wrapped, instance, args, kwargs):
    """wrapt wrapper of `multi_latent_attention.gather_from_tensor_model_parallel_region`."""
    gathered = wrapped(*args, **kwargs)
    call = _call.get()
    if call is None:
        return gathered
    call["gathers"] += 1
    attention = call["attention"]
    config = attention.config
    kv_width = config.kv_lora_rank + config.qk_pos_emb_head_dim
    # the query latent's gather comes first: only a same-width query latent needs the order to tell them apart
    is_kv = gathered.size(-1) == kv_width and (config.q_lora_rank != kv_width or call["gathers"] == 2)
    if not is_kv:
        return gathered
    group = getattr(attention, "tp_group", None)
    group = _default_tp_group() if group is None else group
    return _SumRopeKeyGrad.apply(gathered, config.qk_pos_emb_head_dim, group)


def _default_tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()
