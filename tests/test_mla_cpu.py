"""MLA on CPU (`cpu_testbed`): the MLA core attention against its definition and against transformers'
DeepseekV3 attention with the same weights (RoPE and YaRN, with and without `q_lora_rank`)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lora_patch.proof.testbed.launcher import run_world

ONLY_CPU_COMPAT = {"cpu_compat": True, "lora_linear": False, "finalize_grads": False, "loss_normalization": False}
SEQ, BATCH = 8, 2
#: (q_lora_rank, rope_type): DeepSeek-V3 (q down / up, YaRN), DeepSeek-V2-Lite (linear_q_proj), plain RoPE.
CASES = ((24, "yarn"), (None, "yarn"), (24, "rope"))
YARN = dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
            mscale_all_dim=0.707)
#: Megatron attention name -> transformers DeepseekV3Attention name.
HF_NAMES = {
    "linear_q_proj": "q_proj",
    "linear_q_down_proj": "q_a_proj",
    "q_layernorm": "q_a_layernorm",
    "linear_q_up_proj": "q_b_proj",
    "linear_kv_down_proj": "kv_a_proj_with_mqa",
    "kv_layernorm": "kv_a_layernorm",
    "linear_kv_up_proj": "kv_b_proj",
    "linear_proj": "o_proj",
}


def _mla_attention(q_lora_rank, rope_type):
    """World size 1: Megatron's local-spec MLA self-attention, weights drawn with a fixed seed."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_lora_patch.proof.testbed import mla, models

    spec = models.TinyGPTSpec.mla(q_lora_rank=q_lora_rank, rope_type=rope_type, num_layers=1)
    config = models.transformer_config(spec)
    layer = models.layer_spec(spec)
    attention = build_module(layer.submodules.self_attention, config=config, layer_number=1)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in attention.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.1 * noise if "layernorm" in name else 0.1 * noise)
    assert mla.is_mla(spec)
    return spec, config, attention


def _hf_attention(spec, megatron_attention):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if spec.rope_type == "yarn":
        rope = {**rope, "rope_type": "yarn", **YARN}
    config = DeepseekV3Config(
        hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads, q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.qk_head_dim, qk_rope_head_dim=spec.qk_pos_emb_head_dim, v_head_dim=spec.v_head_dim,
        rms_norm_eps=1e-5, attention_bias=False, attention_dropout=0.0, rope_parameters=rope, rope_interleave=True,
        max_position_embeddings=4096,
    )
    config._attn_implementation = "eager"
    attention = DeepseekV3Attention(config, layer_idx=0)
    if not spec.qk_layernorm:  # Megatron's local spec builds q_lora_rank=None without latent norms (testbed.mla)
        attention.kv_a_layernorm = torch.nn.Identity()
    state = {}
    for name, value in megatron_attention.named_parameters():
        module, _, field = name.rpartition(".")
        if module in HF_NAMES:
            state[f"{HF_NAMES[module]}.{field}"] = value
    attention.load_state_dict(state, strict=True)
    return attention, DeepseekV3RotaryEmbedding(config)


def mla_against_transformers(rank, world_size, cases):
    """Output of Megatron's MLA on CPU and of transformers' DeepseekV3Attention on the same input, per case."""
    import megatron_lora_patch
    from megatron_lora_patch.proof.testbed.topology import Topology

    megatron_lora_patch.apply(plugins=["lora_correct", "cpu_testbed"], enable=ONLY_CPU_COMPAT)
    results = []
    with Topology.parse("tp1").world(cpu_compat=False):
        for q_lora_rank, rope_type in cases:
            spec, _, megatron_attention = _mla_attention(q_lora_rank, rope_type)
            hidden = torch.randn(SEQ, BATCH, spec.hidden_size, generator=torch.Generator().manual_seed(5))
            with torch.no_grad():
                ours, _ = megatron_attention(hidden, attention_mask=None)
                hf, rotary = _hf_attention(spec, megatron_attention)
                positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
                x = hidden.transpose(0, 1)
                mask = torch.full((SEQ, SEQ), float("-inf")).triu(1).expand(BATCH, 1, SEQ, SEQ)
                theirs, _ = hf(x, position_embeddings=rotary(x, positions), attention_mask=mask)
            results.append((ours.transpose(0, 1), theirs, megatron_attention.core_attention.softmax_scale, hf.scaling))
    return results


def core_attention_against_definition(rank, world_size):
    """`MLADotProductAttention` (d_v != d_qk, causal, MLA's softmax scale) vs softmax(scale Q K^T + mask) V."""
    import megatron_lora_patch
    from megatron_lora_patch.proof.testbed.topology import Topology

    megatron_lora_patch.apply(plugins=["lora_correct", "cpu_testbed"], enable=ONLY_CPU_COMPAT)
    with Topology.parse("tp1").world(cpu_compat=False):
        spec, config, attention = _mla_attention(24, "yarn")
        core = attention.core_attention
        heads, d_qk, d_v = spec.num_attention_heads, spec.qk_head_dim + spec.qk_pos_emb_head_dim, spec.v_head_dim
        generator = torch.Generator().manual_seed(11)
        q, k = (torch.randn(SEQ, BATCH, heads, d_qk, generator=generator) for _ in range(2))
        v = torch.randn(SEQ, BATCH, heads, d_v, generator=generator)
        with torch.no_grad():
            ours = core(q, k, v, None)
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) * core.softmax_scale
        scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
        reference = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(SEQ, BATCH, heads * d_v)
        mscale = 0.1 * config.mscale_all_dim * math.log(config.rotary_scaling_factor) + 1.0
        return ours, reference, core.softmax_scale, mscale * mscale / math.sqrt(d_qk)


def test_mla_core_attention_matches_definition():
    ours, reference, scale, expected_scale = run_world(core_attention_against_definition, 1, warnings="ignore")[0]
    assert scale == pytest.approx(expected_scale, rel=1e-12)
    assert scale != pytest.approx(ours.new_tensor(1.0).item() / math.sqrt(24))  # YaRN's mscale is in the scale
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_mla_matches_transformers_deepseek_v3_attention():
    results = run_world(mla_against_transformers, 1, args=(CASES,), warnings="ignore")[0]
    for (q_lora_rank, rope_type), (ours, theirs, scale, hf_scale) in zip(CASES, results):
        assert scale == pytest.approx(hf_scale, rel=1e-9), (q_lora_rank, rope_type)
        error = ((ours - theirs).norm() / theirs.norm()).item()
        assert error < 1e-5, f"q_lora_rank={q_lora_rank} rope_type={rope_type}: relative error {error:.2e}"


def test_mla_spec_refuses_what_the_local_spec_cannot_build_or_shard():
    from megatron_lora_patch.proof.testbed.models import TinyGPTSpec, check_topology_fits
    from megatron_lora_patch.proof.testbed.topology import Topology, TopologyError

    with pytest.raises(ValueError, match="q_lora_rank unset cannot have the latent norms"):
        TinyGPTSpec.mla(q_lora_rank=None, qk_layernorm=True)
    with pytest.raises(TopologyError, match=r"kv_lora_rank \+ qk_pos_emb_head_dim=23 is not divisible by tp2"):
        check_topology_fits(TinyGPTSpec.mla(kv_lora_rank=15), Topology.parse("tp2"))
    check_topology_fits(TinyGPTSpec.mla(), Topology.parse("tp4-sp"))  # heads, latents and vocab divide by 4


def mla_adapters(rank, world_size, q_lora_rank):
    """World size 1, `lora_correct` on: the adapted MLA linears with their parallel mode and which factor is
    replicated (its grad a partial sum over TP), under the default targets."""
    import megatron_lora_patch
    from megatron_lora_patch.lora.adapters.metadata import adapter_info
    from megatron_lora_patch.lora.layers.linear import adapter_of
    from megatron_lora_patch.proof.testbed import models
    from megatron_lora_patch.proof.testbed.topology import Topology

    megatron_lora_patch.apply(plugins=["lora_correct", "cpu_testbed"])
    with Topology.parse("tp1").world(cpu_compat=False):
        model = models.build_model(models.TinyGPTSpec.mla(q_lora_rank=q_lora_rank, num_layers=1))[0]
        found = {}
        for name, module in model.named_modules():
            adapter = adapter_of(module)
            if adapter is not None and ".self_attention." in name:
                replicated = [f for f, p in (("A", adapter.A), ("B", adapter.B)) if adapter_info(p).replicated]
                found[name.rsplit(".", 1)[-1]] = (adapter.parallel_mode, "".join(replicated))
        return found


@pytest.mark.parametrize("q_lora_rank, query", [(24, ("linear_q_down_proj", "linear_q_up_proj")),
                                                (None, ("linear_q_proj",))])
def test_default_targets_adapt_every_mla_linear_with_its_grad_domain(q_lora_rank, query):
    found = run_world(mla_adapters, 1, args=(q_lora_rank,), warnings="ignore")[0]
    expected = {name: ("column", "A") for name in (*query, "linear_kv_down_proj", "linear_kv_up_proj")}
    assert found == {**expected, "linear_proj": ("row", "B")}
