"""The known bugs of LoRA on multi-latent attention (MLA) the oracle's mutations re-introduce.

Like `known_bugs`, each `install(patcher)` bends one invariant through the given `Patcher`
(reverted when the job ends) and is a module-level function (jobs are pickled to spawned ranks).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lora_patch.proof.oracle.known_bugs import _without_replicated
from megatron_lora_patch.runtime.patching import Patcher

MLA_DOWN_PROJECTIONS = ("linear_q_down_proj", "linear_kv_down_proj")


def _is_down_projection_factor(info) -> bool:
    return info.domain == "tp" and info.module.rsplit(".", 1)[-1] in MLA_DOWN_PROJECTIONS


def skip_tp_sum_mla_down_projection(patcher: Patcher) -> None:
    """The replicated factor of MLA's down projections keeps its per-rank partial grad: under SP each
    rank saw its own sequence shard (and its own output shard), and nothing sums them over TP."""
    from megatron_lora_patch.lora.training import grad_sync

    patcher.wrap(grad_sync, "replicated_adapter_params", _without_replicated(_is_down_projection_factor))


def partial_rope_key_grad(patcher: Patcher) -> None:
    """Megatron's own local-spec MLA: the RoPE key's grad stays a partial sum over TP (the `lora_linear`
    fix of `lora.layers.mla_rope_key` undone)."""
    from megatron_lora_patch.lora.layers import mla_rope_key

    patcher.replace(mla_rope_key, "_SumRopeKeyGrad", _NoRopeKeySum)


class _NoRopeKeySum:
    """`_SumRopeKeyGrad` without the sum: the gathered tensor as Megatron returns it."""

    @staticmethod
    def apply(kv_combined: torch.Tensor, rope_dim: int, group: Any) -> torch.Tensor:
        return kv_combined


class _NormThenDelta(torch.nn.Module):
    """`norm(x - delta) + delta`: the latent norm of the base projection, the adapter's term added after it."""

    def __init__(self, norm: torch.nn.Module, delta: torch.Tensor) -> None:
        super().__init__()
        self.norm, self.delta = norm, delta

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return self.norm(latent - self.delta) + self.delta


def _latent_term(instance, adapter, hidden: torch.Tensor) -> torch.Tensor:
    """The kv down projection's adapter term in the layout `kv_layernorm` reads: Megatron's local spec makes the
    projection column-parallel (its input gathered over the sequence under SP), gathers its output over TP, keeps
    the latent's columns and scatters them back over the sequence under SP
    (`MLASelfAttention.get_query_key_value_tensors`)."""
    from megatron.core.tensor_parallel import mappings

    sequence_parallel = instance.config.sequence_parallel
    if sequence_parallel:
        hidden = mappings.gather_from_sequence_parallel_region(hidden)
    term = adapter.scale * (hidden @ adapter.A.t()) @ adapter.up_weight().t()  # no dropout in the oracle
    term = mappings.gather_from_tensor_model_parallel_region(term)[..., : instance.config.kv_lora_rank]
    return mappings.scatter_to_sequence_parallel_region(term) if sequence_parallel else term


def _adapter_after_latent_norm(wrapped, instance, args, kwargs):
    """Run MLA with its kv down projection's adapter term added after `kv_layernorm` instead of before.

    Wraps the attention's `forward` (its input is the down projections')."""
    from megatron_lora_patch.lora.layers.linear import adapter_of

    norm, adapter = instance.kv_layernorm, adapter_of(instance.linear_kv_down_proj)
    delta = _latent_term(instance, adapter, args[0] if args else kwargs["hidden_states"])
    instance.kv_layernorm = _NormThenDelta(norm, delta)
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.kv_layernorm = norm


def kv_adapter_after_latent_norm(patcher: Patcher) -> None:
    """PEFT's kv_a_proj_with_mqa adapter sits before kv_a_layernorm; this one adds its term after it."""
    from megatron.core.transformer import multi_latent_attention

    patcher.wrap(multi_latent_attention.MLASelfAttention, "forward", _adapter_after_latent_norm)
