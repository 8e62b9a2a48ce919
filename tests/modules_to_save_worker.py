"""Rank-side code of the modules_to_save PEFT tests: a tiny GPT whose output layer and embedding were
"trained" (seeded noise on their logical weights) beside its adapters, exported, imported and reloaded.

Ranks return their shards of the fully trained weights with where they sit (`testbed.shards`,
the testbed's own slicing, independent of the import code); the parent assembles them.
"""

from __future__ import annotations

import persistence_worker as persistence
import torch

from megatron_lora_patch.proof.testbed.models import DEFAULT_SEED, logical_state_dict


def trained_names(spec) -> tuple:
    """The logical weights modules_to_save trains: both, or the one weight of tied embeddings."""
    return ("embedding.word_embeddings.weight",) + (() if spec.tie_embeddings else ("output_layer.weight",))


def trained_state_dict(spec) -> dict:
    """The base weights of (spec, DEFAULT_SEED) with the fully trained ones moved by seeded noise."""
    weights = dict(logical_state_dict(spec, DEFAULT_SEED))
    generator = torch.Generator().manual_seed(5)
    for name in trained_names(spec):
        weights[name] = weights[name] + 0.05 * torch.randn(weights[name].shape, generator=generator)
    return weights


def _trained_shards(chunks) -> list:
    from megatron_lora_patch.lora.layers.trained_fully import is_trained_fully
    from megatron_lora_patch.proof.testbed.shards import canonical_items

    return canonical_items(chunks, lambda param: param if is_trained_fully(param) else None)


def export_world(rank: int, world: int, topology: str, spec, seed: int, directory: str, options: dict) -> dict:
    """Full-vocabulary logits of the trained model, and its adapter-only checkpoint."""
    from megatron_lora_patch.lora.checkpoints.checkpoint import save_adapters
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    persistence.setup(persistence.lora_config(seed, **options))
    with Topology.parse(topology).world():
        chunks = build_model(spec, Topology.parse(topology), state_dict=trained_state_dict(spec))
        logits = persistence.full_logits(chunks[0], spec)
        save_adapters(chunks, directory)
        return {"logits": logits, "trained": _trained_shards(chunks)}


def import_world(rank: int, world: int, topology: str, spec, peft_dir: str, directory: str, options: dict) -> dict:
    """Import the PEFT adapter into a base model (other adapters), save it adapter-only, then load that
    checkpoint into a third model: the fully trained shards after import and after the reload."""
    from megatron_lora_patch.lora.checkpoints.checkpoint import load_adapters, save_adapters
    from megatron_lora_patch.lora.exchange.transfer import import_peft
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    persistence.setup(persistence.lora_config(999, **options))
    with Topology.parse(topology).world():
        chunks = build_model(spec, Topology.parse(topology))
        import_peft(chunks, peft_dir)
        save_adapters(chunks, directory)
        reloaded = build_model(spec, Topology.parse(topology))
        before = _trained_shards(reloaded)
        load_adapters(reloaded, directory)
        return {"imported": _trained_shards(chunks), "before": before, "reloaded": _trained_shards(reloaded)}


def assemble(rank_items: list, spec) -> dict:
    """Logical fully trained weights from every rank's shards."""
    from megatron_lora_patch.proof.testbed.shards import assemble_logical

    shapes = {name: tuple(tensor.shape) for name, tensor in logical_state_dict(spec, DEFAULT_SEED).items()}
    return assemble_logical(rank_items, {name: shapes[name] for name in trained_names(spec)})
