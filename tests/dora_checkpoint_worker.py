"""Rank-side code of the DoRA checkpoint test: where `m` comes from across base loads and adapter checkpoints.

One world: a DoRA model on base weights W1 (m = ||W1 + s B A|| per row) writes W1 as a base checkpoint
(adapters left out) and, after `m` moved off that norm (as training moves it), an adapter-only checkpoint.
A second model is built on other base weights W2 (its m = ||W2 + s B A||), loads the base checkpoint through
Megatron's `dist_checkpointing.load` (the `lora_checkpoint` patch: adapters left out of the request) and so
must end with m = ||W1 + s B A||; then `load_adapters` restores the moved m, and its logits equal the first
model's.
"""

from __future__ import annotations

import os
from typing import Dict

import torch
from error_metrics import max_abs_error_over_max
from persistence_worker import full_logits, lora_config, setup


def _magnitudes(chunks) -> Dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in chunks[0].named_parameters() if name.endswith(".lora.m")}


def _max_error(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> float:
    assert actual.keys() == expected.keys() and actual, (sorted(actual), sorted(expected))
    return max(max_abs_error_over_max(actual[name], expected[name]) for name in actual)


def base_then_adapters_world(rank: int, world: int, topology: str, spec, root: str) -> Dict[str, float]:
    from megatron.core import dist_checkpointing

    from megatron_lora_patch.lora.checkpoints.checkpoint import is_adapter_key, load_adapters, save_adapters
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    setup(lora_config(3, dora=True))
    base_dir, adapter_dir = os.path.join(root, "base"), os.path.join(root, "adapters")
    with Topology.parse(topology).world():
        first = build_model(spec, Topology.parse(topology), seed=1)
        from_base = _magnitudes(first)
        base = {key: value for key, value in first[0].sharded_state_dict().items() if not is_adapter_key(key)}
        if rank == 0:
            os.makedirs(base_dir)
        torch.distributed.barrier()
        dist_checkpointing.save(base, base_dir)
        with torch.no_grad():
            for name, param in first[0].named_parameters():
                if name.endswith(".lora.m"):
                    param.mul_(1.0 + 0.1 * torch.arange(param.numel()).remainder(3))  # m off the norm
        trained, logits = _magnitudes(first), full_logits(first[0], spec)
        save_adapters(first, adapter_dir)

        second = build_model(spec, Topology.parse(topology), seed=2)
        errors = {"m_before_load_vs_base_norm": _max_error(_magnitudes(second), from_base)}
        state = second[0].sharded_state_dict()
        second[0].load_state_dict(dist_checkpointing.load(state, base_dir), strict=False)
        errors["m_after_base_load"] = _max_error(_magnitudes(second), from_base)
        load_adapters(second, adapter_dir)
        errors["m_after_adapter_load"] = _max_error(_magnitudes(second), trained)
        errors["logits"] = max_abs_error_over_max(full_logits(second[0], spec), logits)
    return errors
