"""Multi-latent attention (MLA, DeepSeek-V2 / V3) in the testbed's tiny models (`TinyGPTSpec.mla`).

Megatron's local spec builds every MLA linear as a Megatron parallel linear: the down projections
(`linear_q_down_proj`, `linear_kv_down_proj`) and up projections column-parallel (a down projection's
output is gathered over TP, then cut back to the sequence shard under SP), `linear_proj` row-parallel.
Its core attention runs on CPU through `cpu_testbed.mla_attention` (with cp > 1 the testbed's CP attention,
given MLA's head dims the same way). Megatron-Core 0.19's local layers
cannot pair `q_lora_rank` unset with the latent norms (its norm check then wants a fused norm +
linear, which only Transformer Engine has), so that variant is built without them.
"""

from __future__ import annotations

from typing import Any


def is_mla(spec: Any) -> bool:
    """True when `spec` (a `TinyGPTSpec`) uses multi-latent attention."""
    return spec.kv_lora_rank is not None


def q_head_dim(spec: Any) -> int:
    """Query / key head dim: the no-position part plus the RoPE part."""
    return spec.qk_head_dim + spec.qk_pos_emb_head_dim


def check(spec: Any) -> None:
    """Raise `ValueError` for an MLA spec the local layers cannot build."""
    if spec.rope_type not in ("rope", "yarn"):
        raise ValueError(f"rope_type must be 'rope' or 'yarn', got {spec.rope_type!r}")
    if not is_mla(spec):
        return
    if spec.hybrid_pattern:
        raise ValueError("multi-latent attention is built for GPT models only, not with hybrid_pattern")
    if spec.q_lora_rank is None and spec.qk_layernorm:
        raise ValueError(
            "MLA with q_lora_rank unset cannot have the latent norms (qk_layernorm) in Megatron's local spec: "
            "its norm check then wants Transformer Engine's fused norm + linear; set qk_layernorm=False"
        )


def attention_shapes(spec: Any, prefix: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of one MLA self-attention's parameters (`prefix` ends with `self_attention.`)."""
    hidden, heads = spec.hidden_size, spec.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {}
    if spec.q_lora_rank is None:
        shapes[prefix + "linear_q_proj.weight"] = (heads * q_head_dim(spec), hidden)
    else:
        shapes[prefix + "linear_q_down_proj.weight"] = (spec.q_lora_rank, hidden)
        if spec.qk_layernorm:
            shapes[prefix + "q_layernorm.weight"] = (spec.q_lora_rank,)
        shapes[prefix + "linear_q_up_proj.weight"] = (heads * q_head_dim(spec), spec.q_lora_rank)
    shapes[prefix + "linear_kv_down_proj.weight"] = (spec.kv_lora_rank + spec.qk_pos_emb_head_dim, hidden)
    if spec.qk_layernorm:
        shapes[prefix + "kv_layernorm.weight"] = (spec.kv_lora_rank,)
    shapes[prefix + "linear_kv_up_proj.weight"] = (heads * (spec.qk_head_dim + spec.v_head_dim), spec.kv_lora_rank)
    shapes[prefix + "linear_proj.weight"] = (hidden, heads * spec.v_head_dim)
    return shapes


def tensor_sharded_dimensions(spec: Any) -> dict[str, int]:
    """The MLA widths tensor parallelism splits (the local spec's down projections are column-parallel)."""
    dimensions = {"kv_lora_rank + qk_pos_emb_head_dim": spec.kv_lora_rank + spec.qk_pos_emb_head_dim}
    if spec.q_lora_rank is not None:
        dimensions["q_lora_rank"] = spec.q_lora_rank
    return dimensions


def config_options(spec: Any) -> dict[str, Any]:
    """`MLATransformerConfig` fields of `spec`; YaRN with DeepSeek-V3's factor, mscale 1 and DeepSeek-V2's
    mscale_all_dim 0.707, so both the softmax scale and the cos / sin carry an mscale. Megatron puts the
    mscale into the softmax scale for plain RoPE too: its scaling factor is 1 there (no mscale)."""
    return dict(
        multi_latent_attention=True,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_head_dim=spec.qk_head_dim,
        qk_pos_emb_head_dim=spec.qk_pos_emb_head_dim,
        v_head_dim=spec.v_head_dim,
        rope_type=spec.rope_type,
        rotary_base=10000,
        rotary_scaling_factor=40.0 if spec.rope_type == "yarn" else 1.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=0.707,
    )
