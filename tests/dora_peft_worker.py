"""Rank-side code of the DoRA PEFT exchange tests (tests/test_persistence_peft_dora.py).

`export_world`: a DoRA model whose magnitudes moved off their initial norm (as training moves them) returns its
logits and writes an adapter-only checkpoint. `import_world`: fresh DoRA adapters (another seed) import a PEFT
adapter, return the logits and their magnitudes, and write an adapter-only checkpoint (for the export back).
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
    from megatron_lora_patch.lora.checkpoints.checkpoint import save_adapters
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    setup(lora_config(seed, dora=True, **options))
    with Topology.parse(topology).world():
        chunks = build_model(spec, Topology.parse(topology))
        _move_magnitudes(chunks[0])
        save_adapters(chunks, directory)
        return {"adapted": full_logits(chunks[0], spec)}


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
        magnitudes = {n: p.detach().clone() for n, p in chunks[0].named_parameters() if n.endswith(".lora.m")}
        return {"logits": full_logits(chunks[0], spec), "magnitudes": magnitudes}
