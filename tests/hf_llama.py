"""`transformers` models holding the testbed's logical base weights (the external reference):
LlamaForCausalLM for the dense testbed, MixtralForCausalLM or Qwen3MoeForCausalLM (with
`qk_layernorm`: Megatron's q / k layernorm are Qwen3's per-head q_norm / k_norm) for the MoE one.

The testbed model is Llama-shaped: RMSNorm (Megatron's default eps 1e-5), GQA, SwiGLU,
RoPE (base 10000, rotate-half), no linear biases, untied embeddings (tied: `lm_head` is the embedding). Its weights map
to HF names with the qkv rows split out of Megatron's per-query-group layout and fc1
split into gate / up; a wrong split shows up as a logits mismatch. MoE layers: the router is
`mlp.gate`, and expert e's fc1 / fc2 weights are `mlp.experts.gate_up_proj[e]` / `down_proj[e]`
(transformers 5 keeps experts as 3D parameters; fc1 rows `[gate; up]` as in `gate_up_proj`).
Mixtral routes like Megatron's default router (softmax over the top-k logits = top-k of the
softmax, renormalized).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_lora_patch.lora.adapters.layouts import fc1_to_gate_up, qkv_mixed_to_separate
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec, logical_state_dict

MEGATRON_NORM_EPS = 1e-5  # TransformerConfig.layernorm_epsilon default
MEGATRON_ROTARY_BASE = 10000.0  # GPTModel rotary_base default


def hf_state_dict(spec: TinyGPTSpec, seed: int, weights: Optional[dict] = None) -> dict:
    """HF names for the testbed's logical weights (those of (spec, seed) unless `weights` are given)."""
    weights = weights if weights is not None else logical_state_dict(spec, seed)
    out = {
        "model.embed_tokens.weight": weights["embedding.word_embeddings.weight"],
        "model.norm.weight": weights["decoder.final_layernorm.weight"],
        "lm_head.weight": weights[
            "output_layer.weight" if "output_layer.weight" in weights else "embedding.word_embeddings.weight"
        ],
    }
    for layer in range(spec.num_layers):
        src, dst = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        q, k, v = qkv_mixed_to_separate(
            weights[src + "self_attention.linear_qkv.weight"],
            spec.num_attention_heads,
            spec.num_query_groups,
            spec.kv_channels,
        )
        out.update(_mlp(spec, weights, src, dst))
        if spec.qk_layernorm:
            out[dst + "self_attn.q_norm.weight"] = weights[src + "self_attention.q_layernorm.weight"]
            out[dst + "self_attn.k_norm.weight"] = weights[src + "self_attention.k_layernorm.weight"]
        out.update(
            {
                dst + "input_layernorm.weight": weights[src + "input_layernorm.weight"],
                dst + "post_attention_layernorm.weight": weights[src + "pre_mlp_layernorm.weight"],
                dst + "self_attn.q_proj.weight": q,
                dst + "self_attn.k_proj.weight": k,
                dst + "self_attn.v_proj.weight": v,
                dst + "self_attn.o_proj.weight": weights[src + "self_attention.linear_proj.weight"],
            }
        )
    return out


def _mlp(spec: TinyGPTSpec, weights: dict, src: str, dst: str) -> dict:
    if spec.is_moe:
        experts = [f"{src}mlp.experts.local_experts.{e}." for e in range(spec.num_experts)]
        return {
            dst + "mlp.gate.weight": weights[src + "mlp.router.weight"],
            dst + "mlp.experts.gate_up_proj": torch.stack([weights[e + "linear_fc1.weight"] for e in experts]),
            dst + "mlp.experts.down_proj": torch.stack([weights[e + "linear_fc2.weight"] for e in experts]),
        }
    gate, up = fc1_to_gate_up(weights[src + "mlp.linear_fc1.weight"])
    return {
        dst + "mlp.gate_proj.weight": gate,
        dst + "mlp.up_proj.weight": up,
        dst + "mlp.down_proj.weight": weights[src + "mlp.linear_fc2.weight"],
    }


def llama_config(spec: TinyGPTSpec):
    """The LlamaConfig of the testbed's dense model (fp32, eager attention)."""
    from transformers import LlamaConfig

    return LlamaConfig(intermediate_size=spec.ffn_hidden_size, mlp_bias=False, **_common(spec))


def llama_for(spec: TinyGPTSpec, seed: int, weights: Optional[dict] = None):
    """LlamaForCausalLM (fp32, eager attention, eval mode) with the logical base weights of (spec, seed),
    or `weights` (the testbed's logical names)."""
    from transformers import LlamaForCausalLM

    return _load(LlamaForCausalLM, llama_config(spec), spec, seed, weights)


def mixtral_for(spec: TinyGPTSpec, seed: int, weights: Optional[dict] = None):
    """MixtralForCausalLM (fp32, eager, eval) with the logical base weights of the MoE `spec` (or `weights`)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        intermediate_size=spec.expert_ffn_hidden_size,
        num_local_experts=spec.num_experts,
        num_experts_per_tok=spec.moe_router_topk,
        router_jitter_noise=0.0,
        **_common(spec),
    )
    return _load(MixtralForCausalLM, config, spec, seed, weights)


def qwen3_moe_for(spec: TinyGPTSpec, seed: int, weights: Optional[dict] = None):
    """Qwen3MoeForCausalLM (fp32, eager, eval) with the logical base weights of the MoE `spec` with
    `qk_layernorm` (or `weights`); top-k probabilities renormalized, like Megatron's router."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        moe_intermediate_size=spec.expert_ffn_hidden_size,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.moe_router_topk,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **_common(spec),
    )
    return _load(Qwen3MoeForCausalLM, config, spec, seed, weights)


def _common(spec: TinyGPTSpec) -> dict:
    return dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_query_groups,
        head_dim=spec.kv_channels,
        max_position_embeddings=spec.seq_length,
        rms_norm_eps=MEGATRON_NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": MEGATRON_ROTARY_BASE},
        tie_word_embeddings=spec.tie_embeddings,
        attention_bias=False,
        hidden_act="silu",
        attn_implementation="eager",
        torch_dtype=torch.float32,
    )


def _load(model_class, config, spec: TinyGPTSpec, seed: int, weights: Optional[dict]):
    model = model_class(config)
    missing, unexpected = model.load_state_dict(hf_state_dict(spec, seed, weights), strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    return model.eval()
