"""Rank-side code of the Megatron-LM loop test: the testbed GPT holding a Megatron-LM checkpoint.

`logits_world` builds the testbed model (world size 1) with the base weights read from a
Megatron-LM checkpoint, loads that checkpoint's adapters with `load_adapters` (it reads the
description the plugin recorded there) and returns the full-vocab logits of a fixed batch.
"""

from __future__ import annotations

import torch


def testbed_weights(tensors: dict, spec) -> dict:
    """The testbed's logical per-layer names for the base tensors of a Megatron-LM checkpoint.

    The checkpoint stacks layers on axis 0 and keeps the local spec's norms under the
    fused-linear names (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`).
    """
    renamed = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    }
    weights = {}
    for key, tensor in tensors.items():
        if ".lora." in key:
            continue
        if not key.startswith("decoder.layers."):
            weights[key] = tensor
            continue
        module = key[len("decoder.layers."):]
        for layer in range(spec.num_layers):
            weights[f"decoder.layers.{layer}.{renamed.get(module, module)}"] = tensor[layer]
    return weights


def logits_world(rank: int, world: int, spec, weights: dict, checkpoint_dir: str, rank_of_lora: int) -> torch.Tensor:
    from persistence_worker import full_logits, setup

    from megatron_lora_patch.lora.checkpoints.checkpoint import load_adapters
    from megatron_lora_patch.lora.config import LoraConfig
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    setup(LoraConfig(rank=rank_of_lora))
    topology = Topology.parse("tp1")
    with topology.world():
        chunks = build_model(spec, topology, state_dict=weights)
        load_adapters(chunks, checkpoint_dir)
        return full_logits(chunks[0], spec)
