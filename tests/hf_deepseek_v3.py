"""DeepSeek-V3 (`transformers`' DeepseekV3ForCausalLM, fp32, eager) holding the testbed's logical weights of a
DeepSeek-shaped spec: multi-latent attention with both latents (`TinyGPTSpec.mla`), one leading dense layer,
then MoE layers with DeepSeek's routing and shared experts (`SPEC`).

Routing agrees only where transformers' group score (the sum of a group's top 2) is Megatron's (the sum of its
top `topk / group_topk`): here 2 / 1, as in DeepSeek-V3 itself (256 experts, 8 groups, top 4 of them, top-8).
The expert bias is zeros on both sides (HF's `e_score_correction_bias` init, Megatron's `expert_bias` init).
The shared experts' width is `n_shared_experts * moe_intermediate_size` in transformers: 2 * 32 here.
transformers builds the latent norms with eps 1e-6 whatever `rms_norm_eps` says (DeepSeek-V3's own value for
every norm); Megatron has one `layernorm_epsilon` (1e-5 in the testbed), given to them here.
"""

from __future__ import annotations

import contextlib

import hf_llama
import torch

from megatron_lora_patch.lora.adapters.layouts import fc1_to_gate_up
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec, logical_state_dict

SHARED_EXPERTS = 2
SPEC = TinyGPTSpec.mla(
    num_layers=2, num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
    moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=SHARED_EXPERTS * 32, first_dense_layers=1,
)
#: Megatron attention name -> transformers DeepseekV3Attention name (tests/test_mla_cpu.py checks the attention).
ATTENTION = {"linear_q_proj": "q_proj", "linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm",
             "linear_q_up_proj": "q_b_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa",
             "kv_layernorm": "kv_a_layernorm", "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj"}
YARN = dict(rope_type="yarn", rope_theta=hf_llama.MEGATRON_ROTARY_BASE, factor=40.0,  # testbed.mla.config_options
            original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707)


def config(spec: TinyGPTSpec = SPEC):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
        moe_intermediate_size=spec.expert_ffn_hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_attention_heads,
        n_shared_experts=spec.moe_shared_expert_intermediate_size // spec.expert_ffn_hidden_size,
        n_routed_experts=spec.num_experts, routed_scaling_factor=spec.moe_router_topk_scaling_factor,
        kv_lora_rank=spec.kv_lora_rank, q_lora_rank=spec.q_lora_rank, qk_rope_head_dim=spec.qk_pos_emb_head_dim,
        v_head_dim=spec.v_head_dim, qk_nope_head_dim=spec.qk_head_dim, n_group=spec.moe_router_num_groups,
        topk_group=spec.moe_router_group_topk, num_experts_per_tok=spec.moe_router_topk,
        first_k_dense_replace=spec.first_dense_layers, norm_topk_prob=True, hidden_act="silu",
        max_position_embeddings=4096, rms_norm_eps=hf_llama.MEGATRON_NORM_EPS, rope_parameters=dict(YARN),
        rope_interleave=True, attention_bias=False, attention_dropout=0.0, tie_word_embeddings=spec.tie_embeddings,
        attn_implementation="eager", torch_dtype=torch.float32,
    )


def _mlp(spec: TinyGPTSpec, weights: dict, layer: int) -> dict:
    src, dst = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
    if layer < spec.first_dense_layers:
        gate, up = fc1_to_gate_up(weights[src + "linear_fc1.weight"])
        return {dst + "gate_proj.weight": gate, dst + "up_proj.weight": up, dst + "down_proj.weight":
                weights[src + "linear_fc2.weight"]}
    experts = [f"{src}experts.local_experts.{e}." for e in range(spec.num_experts)]
    gate, up = fc1_to_gate_up(weights[src + "shared_experts.linear_fc1.weight"])
    return {
        dst + "gate.weight": weights[src + "router.weight"],
        dst + "experts.gate_up_proj": torch.stack([weights[e + "linear_fc1.weight"] for e in experts]),
        dst + "experts.down_proj": torch.stack([weights[e + "linear_fc2.weight"] for e in experts]),
        dst + "shared_experts.gate_proj.weight": gate, dst + "shared_experts.up_proj.weight": up,
        dst + "shared_experts.down_proj.weight": weights[src + "shared_experts.linear_fc2.weight"],
    }


def hf_state_dict(spec: TinyGPTSpec, seed: int) -> dict:
    """transformers' names for the testbed's logical weights of (spec, seed)."""
    weights = logical_state_dict(spec, seed)
    out = {"model.embed_tokens.weight": weights["embedding.word_embeddings.weight"],
           "model.norm.weight": weights["decoder.final_layernorm.weight"],
           "lm_head.weight": weights["output_layer.weight"]}
    for layer in range(spec.num_layers):
        src, dst = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        out[dst + "input_layernorm.weight"] = weights[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = weights[src + "pre_mlp_layernorm.weight"]
        for name, value in weights.items():
            module, _, field = name[len(src + "self_attention.") :].rpartition(".")
            if name.startswith(src + "self_attention.") and module in ATTENTION:
                out[f"{dst}self_attn.{ATTENTION[module]}.{field}"] = value
        out.update(_mlp(spec, weights, layer))
    return out


def deepseek_v3_for(spec: TinyGPTSpec, seed: int):
    """DeepseekV3ForCausalLM (fp32, eager, eval) with the logical base weights of (spec, seed)."""
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(config(spec))
    for layer in model.model.layers:  # transformers fixes the latent norms' eps at 1e-6; Megatron's is every norm's
        for norm in (layer.self_attn.q_a_layernorm, layer.self_attn.kv_a_layernorm):
            norm.variance_epsilon = hf_llama.MEGATRON_NORM_EPS
    missing, unexpected = model.load_state_dict(hf_state_dict(spec, seed), strict=False)
    assert not unexpected and all("e_score_correction_bias" in name for name in missing), (missing, unexpected)
    return model.eval()


@contextlib.contextmanager
def without_peft_v4_renames():
    """peft (0.21) on transformers 5 rewrites the config of a `deepseek_v3` adapter as if it were written for
    transformers 4 (its conversion pattern for `deepseek_v3` is `qwen2_moe`'s): every target module named
    `gate_proj` / `up_proj` / `down_proj` becomes the routed experts' fused parameter at twice the rank
    (peft/utils/transformers_weight_conversion.py, `_convert_peft_config_moe`), so the dense layers' and shared
    experts' adapters are dropped and the experts' shapes refused. The export is in transformers 5's layout
    already: load it with that rewrite off."""
    from peft.utils import transformers_weight_conversion as conversion

    original = conversion._convert_peft_config_moe
    conversion._convert_peft_config_moe = lambda config, model: None
    try:
        yield
    finally:
        conversion._convert_peft_config_moe = original
