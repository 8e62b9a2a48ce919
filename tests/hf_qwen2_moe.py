"""Qwen2-MoE (`transformers`' Qwen2MoeForCausalLM) holding the MoE testbed's logical weights plus shared experts.

Megatron's shared experts (`moe_shared_expert_intermediate_size`, `moe_shared_expert_gate`) are a
dense SwiGLU MLP whose output is scaled by `sigmoid(x @ gate_weight^T)` and added to the routed
experts' output: exactly Qwen2-MoE's `mlp.shared_expert` and `mlp.shared_expert_gate`. The
testbed draws no shared-expert weights, so `logical_weights` adds them (from (seed, name) alone,
like the rest). Qwen2-MoE routes as Megatron's default router with `norm_topk_prob=True`;
its q / k / v biases are off (`qkv_bias=False`), as in the testbed.
"""

from __future__ import annotations

import hf_llama
import torch

from megatron_lora_patch.proof.testbed.models import TinyGPTSpec, logical_state_dict

SHARED_SIZE = 48  # shared experts' ffn width: divides TP 2, differs from the routed experts' 32


def shared_shapes(spec: TinyGPTSpec, size: int = SHARED_SIZE) -> dict:
    """Logical shapes of every layer's shared-expert weights (Megatron names)."""
    shapes = {}
    for layer in range(spec.num_layers):
        prefix = f"decoder.layers.{layer}.mlp.shared_experts."
        shapes[prefix + "linear_fc1.weight"] = (2 * size, spec.hidden_size)
        shapes[prefix + "linear_fc2.weight"] = (spec.hidden_size, size)
        shapes[prefix + "gate_weight"] = (1, spec.hidden_size)
    return shapes


def logical_weights(spec: TinyGPTSpec, seed: int, size: int = SHARED_SIZE) -> dict:
    """The testbed's logical weights of the MoE `spec` plus its shared experts (std 0.02; the gate 0.2,
    so the sigmoid is not flat at 1/2)."""
    weights = logical_state_dict(spec, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, shape in sorted(shared_shapes(spec, size).items()):
        scale = 0.2 if name.endswith("gate_weight") else spec.init_std
        weights[name] = scale * torch.randn(shape, generator=generator)
    return weights


def build_options(spec: TinyGPTSpec, seed: int, size: int = SHARED_SIZE) -> dict:
    """`build_model` keyword arguments for the model with shared experts."""
    return {"state_dict": logical_weights(spec, seed, size), "moe_shared_expert_intermediate_size": size,
            "moe_shared_expert_gate": True}


def qwen2_moe_for(spec: TinyGPTSpec, seed: int, size: int = SHARED_SIZE):
    """Qwen2MoeForCausalLM (fp32, eager, eval) with the logical weights of `logical_weights(spec, seed, size)`."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    weights = logical_weights(spec, seed, size)
    config = Qwen2MoeConfig(
        moe_intermediate_size=spec.expert_ffn_hidden_size, shared_expert_intermediate_size=size,
        num_experts=spec.num_experts, num_experts_per_tok=spec.moe_router_topk, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=False, **hf_llama._common(spec),
    )
    model = Qwen2MoeForCausalLM(config)
    state = hf_llama.hf_state_dict(spec, seed, weights)
    for layer in range(spec.num_layers):
        src, dst = f"decoder.layers.{layer}.mlp.shared_experts.", f"model.layers.{layer}.mlp.shared_expert"
        gate, up = torch.chunk(weights[src + "linear_fc1.weight"], 2, dim=0)
        state.update({f"{dst}.gate_proj.weight": gate, f"{dst}.up_proj.weight": up,
                      f"{dst}.down_proj.weight": weights[src + "linear_fc2.weight"],
                      f"{dst}_gate.weight": weights[src + "gate_weight"]})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in name for name in missing), (missing, unexpected)
    return model.eval()
