"""Rank-side code of the DoRA PEFT exchange tests (tests/test_persistence_peft_dora.py).

`export_world`: a DoRA model whose magnitudes moved off their initial norm (as training moves them) returns its
logits, writes an adapter-only checkpoint and merges its adapters (DoRA's row scale) and back.
`import_world`: fresh DoRA adapters (another seed) import a PEFT adapter, return the logits and write an
adapter-only checkpoint (for the export back).
"""

from __future__ import annotations

from typing import Dict

import torch
from persistence_worker import full_logits, lora_config, setup


def _move_magnitudes(model: torch.nn.Module) -> None:
    """m off ||W + s B A||, by a factor per output row that every TP rank computes alike for its rows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".lora.m"):
                param.mul_(1.0 + 0.2 * torch.cos(param.detach() * 37.0))


def export_world(rank: int, world: int, topology: str, spec, seed: int, directory: str, options: dict) -> Dict:
    """Logits with the adapters, an adapter-only checkpoint, then logits merged / unmerged and the weight drift."""
    from megatron_lora_patch.lora.adapters.merge import merge_adapters, unmerge_adapters
    from megatron_lora_patch.lora.checkpoints.checkpoint import save_adapters
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    setup(lora_config(seed, dora=True, **options))
    with Topology.parse(topology).world():
        chunks = build_model(spec, Topology.parse(topology))
        model = chunks[0]
        _move_magnitudes(model)
        save_adapters(chunks, directory)
        adapted = full_logits(model, spec)
        weights = {name: p.detach().clone() for name, p in model.named_parameters() if ".lora." not in name}
        merged = merge_adapters(chunks)
        merged_logits = full_logits(model, spec)
        unmerge_adapters(merged)
        drift = max((p.detach() - weights[n]).abs().max().item() for n, p in model.named_parameters() if n in weights)
        return {"adapted": adapted, "merged": merged_logits, "unmerged": full_logits(model, spec),
                "merged_count": len(merged), "weight_drift": drift}


def import_world(rank: int, world: int, topology: str, spec, peft_dir: str, directory: str, options: dict) -> Dict:
    from megatron_lora_patch.lora.checkpoints.checkpoint import save_adapters
    from megatron_lora_patch.lora.exchange.transfer import import_peft
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    setup(lora_config(999, dora=True, **options))
    with Topology.parse(topology).world():
        chunks = build_model(spec, Topology.parse(topology))
        import_peft(chunks, peft_dir)
        save_adapters(chunks, directory)
        return {"logits": full_logits(chunks[0], spec)}


def merge_calls_world(rank: int, world: int, topology: str, spec, seed: int, dora: bool, calls) -> list:
    """A model with adapters of `seed` (DoRA or plain); this rank's `merge_adapters` calls in order: each (what it
    passes: "model" or "first layer", timeout), or None for a call this rank skips. Per call (outcome, seconds):
    "merged N" with N adapters merged (then unmerged), or the UsageError's message."""
    from rank_calls import make_calls

    return make_calls(rank, topology, spec, lora_config(seed, dora=dora), calls, _merge_and_unmerge)


def _merge_and_unmerge(chunks: list, call: tuple) -> str:
    from megatron_lora_patch.lora.adapters.merge import merge_adapters, unmerge_adapters

    passed = {"model": chunks, "first layer": [chunks[0].decoder.layers[0]]}[call[0]]
    merged = merge_adapters(passed, timeout=call[1])
    unmerge_adapters(merged)
    return f"merged {len(merged)}"
