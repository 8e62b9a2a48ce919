"""The tiny models' logical layout: every parameter's world-size-1 name and shape, the weights drawn from
(seed, name) alone, and whether a topology can shard the model (`models.TinyGPTSpec` describes it; `spec`
below is one). Nothing here builds Megatron modules: `models.build_model` loads these weights into them.
"""

from __future__ import annotations

import hashlib
from typing import Any

from megatron_lora_patch.proof.testbed import mla

DEFAULT_SEED = 1234


def _sharded_dimensions(spec: Any) -> dict[str, dict[str, int]]:
    """Parallel size -> the model dimensions Megatron splits by it (each must divide evenly)."""
    tensor = {
        "num_attention_heads": spec.num_attention_heads,
        "num_query_groups": spec.num_query_groups,
        "vocab_size": spec.vocab_size,
    }
    if not spec.is_moe or spec.first_dense_layers:  # the MoE model's leading dense layers split theirs
        tensor["ffn_hidden_size"] = spec.ffn_hidden_size
    if spec.is_moe and spec.moe_shared_expert_intermediate_size:  # shared experts: on the dense TP group
        tensor["moe_shared_expert_intermediate_size"] = spec.moe_shared_expert_intermediate_size
    if mla.is_mla(spec):
        tensor.update(mla.tensor_sharded_dimensions(spec))
    return {"tp": tensor, "etp": {"moe_ffn_hidden_size": spec.expert_ffn_hidden_size} if spec.is_moe else {}}


def check_topology_fits(spec: Any, topology: Any) -> None:
    """Raise one `TopologyError` if `topology` cannot run `spec`: heads, query groups, vocab and
    ffn (expert ffn) must divide by tp (etp), plus `Topology.validate` (experts, layers, sequence)."""
    from megatron_lora_patch.proof.testbed.topology import TopologyError

    problems = []
    for part, dimensions in _sharded_dimensions(spec).items():
        size = getattr(topology, part)
        uneven = [f"{name}={value}" for name, value in dimensions.items() if value % size]
        if uneven:
            fitting = [str(n) for n in range(1, 9) if all(value % n == 0 for value in dimensions.values())]
            problems.append(
                f"{', '.join(uneven)} {'is' if len(uneven) == 1 else 'are'} not divisible by {part}{size}; "
                f"use {part} in {{{', '.join(fitting)}}}"
            )
    try:
        topology.validate(num_experts=spec.num_experts, num_layers=spec.num_layers, seq_length=spec.seq_length)
    except TopologyError as error:
        problems.append(error.reason)
    if problems:
        raise TopologyError("; ".join(problems), subject=f"topology {str(topology)!r} does not fit the model")


def logical_shapes(spec: Any) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the world-size-1 model (Megatron's names and layouts).

    `linear_qkv.weight` rows are Megatron's grouped layout [q_g0, k_g0, v_g0, q_g1, ...];
    `linear_fc1.weight` rows are [gate; up] (SwiGLU).
    """
    hidden, kv = spec.hidden_size, spec.kv_channels
    qkv_rows = (spec.num_attention_heads + 2 * spec.num_query_groups) * kv
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (spec.vocab_size, hidden)}
    for layer, kind in enumerate(spec.layer_kinds()):
        prefix = f"decoder.layers.{layer}."
        if kind in "G*":
            shapes[prefix + "input_layernorm.weight"] = (hidden,)
        if kind in "G*" and mla.is_mla(spec):
            shapes.update(mla.attention_shapes(spec, prefix + "self_attention."))
        elif kind in "G*":
            shapes[prefix + "self_attention.linear_qkv.weight"] = (qkv_rows, hidden)
            shapes[prefix + "self_attention.linear_proj.weight"] = (hidden, spec.num_attention_heads * kv)
            if spec.qk_layernorm:
                shapes[prefix + "self_attention.q_layernorm.weight"] = (kv,)
                shapes[prefix + "self_attention.k_layernorm.weight"] = (kv,)
        if kind == "*":
            continue
        shapes[prefix + "pre_mlp_layernorm.weight"] = (hidden,)
        if spec.is_moe and layer >= spec.first_dense_layers:
            shapes.update(_moe_shapes(spec, prefix + "mlp."))
        else:
            shapes[prefix + "mlp.linear_fc1.weight"] = (2 * spec.ffn_hidden_size, hidden)
            shapes[prefix + "mlp.linear_fc2.weight"] = (hidden, spec.ffn_hidden_size)
    if not spec.hybrid_pattern:  # the hybrid stack's final norm is TE-only: built without one (hybrid_stack_spec)
        shapes["decoder.final_layernorm.weight"] = (hidden,)
    if not spec.tie_embeddings:
        shapes["output_layer.weight"] = (spec.vocab_size, hidden)
    return shapes


def _moe_shapes(spec: Any, prefix: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of one MoE layer's router, routed experts and shared experts (`prefix` ends with `mlp.`)."""
    hidden, ffn = spec.hidden_size, spec.expert_ffn_hidden_size
    shapes = {prefix + "router.weight": (spec.num_experts, hidden)}
    for expert in range(spec.num_experts):
        expert_prefix = f"{prefix}experts.local_experts.{expert}."
        shapes[expert_prefix + "linear_fc1.weight"] = (2 * ffn, hidden)
        shapes[expert_prefix + "linear_fc2.weight"] = (hidden, ffn)
    shared = spec.moe_shared_expert_intermediate_size
    if shared:
        shapes[prefix + "shared_experts.linear_fc1.weight"] = (2 * shared, hidden)
        shapes[prefix + "shared_experts.linear_fc2.weight"] = (hidden, shared)
    return shapes


def _name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def logical_state_dict(spec: Any, seed: int = DEFAULT_SEED) -> dict[str, Any]:
    """The full world-size-1 weights (fp32, CPU), each drawn from (seed, name) only.

    Norm weights are 1 + noise (not all ones) so a wrong norm shard or a missing norm
    grad reduction changes results.
    """
    import torch

    weights = {}
    for name, shape in logical_shapes(spec).items():
        generator = torch.Generator().manual_seed(_name_seed(seed, name))
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        weights[name] = 1.0 + 0.1 * noise if name.endswith("layernorm.weight") else spec.init_std * noise
    return weights
