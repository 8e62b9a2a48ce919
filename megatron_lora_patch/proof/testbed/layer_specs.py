"""The testbed's Megatron layer specs: the local (non-TE) GPT layer spec, its core attention swapped where the
topology or the data needs the testbed's (context parallelism, packed sequences, MLA's head widths), and the
hybrid stack cut from it (`models.build_model` uses both; `spec` is a `models.TinyGPTSpec`)."""

from __future__ import annotations

from typing import Any

from megatron_lora_patch.proof.testbed import mla


def layer_spec(spec: Any, topology: Any = None):
    """Megatron's local (non-TE) GPT layer spec: RMSNorm, SequentialMLP experts for MoE.

    With cp > 1 or packed sequences the core attention is the testbed's
    `cp_attention.ContextParallelDotProductAttention` (Megatron's local attention has neither);
    otherwise, world size 1 included, it stays Megatron's own `DotProductAttention`.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer = get_gpt_layer_local_spec(
        num_experts=spec.num_experts, moe_grouped_gemm=False, normalization="RMSNorm", qk_layernorm=spec.qk_layernorm,
        multi_latent_attention=mla.is_mla(spec),
    )
    if getattr(topology, "cp", 1) > 1 or spec.packed:
        from megatron_lora_patch.cpu_testbed.mla_attention import mla_attention_class
        from megatron_lora_patch.proof.testbed.cp_attention import ContextParallelDotProductAttention

        attention = mla_attention_class(ContextParallelDotProductAttention) if mla.is_mla(spec) else None
        layer.submodules.self_attention.submodules.core_attention = attention or ContextParallelDotProductAttention
    return layer


def hybrid_stack_spec(spec: Any, topology: Any = None):
    """A local (non-TE) `HybridStack` spec (Megatron-Core 0.18+; `MambaStack` before) for the attention
    (`*`) and MLP (`-`) layers of a hybrid pattern, cut from the GPT local layer spec: their linears are
    the GPT model's. No final norm (`logical_shapes` has none for a hybrid spec)."""
    from megatron_lora_patch.proof.testbed.hybrid_stack import local_stack_spec

    return local_stack_spec(layer_spec(spec, topology), final_norm=False)


def decoder_spec(spec: Any, config: Any, topology: Any = None):
    """The GPT decoder's spec: `layer_spec` for every layer, or with `first_dense_layers` (DeepSeek's leading
    dense layers, `moe_layer_freq`) a block of this pipeline stage's layers, dense ones first (even stages)."""
    if not spec.first_dense_layers:
        return layer_spec(spec, topology)
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, _get_block_submodules

    moe = layer_spec(spec, topology)
    dense = layer_spec(spec.replace(num_experts=None), topology)
    layers = [dense] * spec.first_dense_layers + [moe] * (spec.num_layers - spec.first_dense_layers)
    per_stage = spec.num_layers // parallel_state.get_pipeline_model_parallel_world_size()
    start = parallel_state.get_pipeline_model_parallel_rank() * per_stage
    norm = _get_block_submodules(config, moe).layer_norm  # the final norm Megatron gives a layer spec's block
    return TransformerBlockSubmodules(layer_specs=layers[start : start + per_stage], layer_norm=norm)
