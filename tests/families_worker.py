"""Rank-side code of the export family tests: adapter checkpoints of models a family must be checked against.

`save_world` (world size 1) writes two adapter-only checkpoints with the plugin's own `save_adapters`
/ Megatron's `dist_checkpointing`:

- `defaults`: a `GPTModel` built with Megatron-Core's defaults (learned absolute positions, LayerNorm,
  a non-gated GeLU MLP, linear biases, tied embeddings): no Hugging Face family here can hold it;
- `older`: the Llama-shaped testbed model, its description written without the architecture fields
  (lora/inventory.py `FIELDS`), as checkpoints from before they existed are.
"""

from __future__ import annotations

import os

DEFAULTS, OLDER = "defaults", "older"


def _megatron_defaults_gpt(spec, topology):
    """A GPTModel with Megatron-Core's own defaults for what a family must represent (tiny widths)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_lora_patch.proof.testbed.models import transformer_config

    config = transformer_config(
        spec, topology, normalization="LayerNorm", gated_linear_unit=False, activation_func=F.gelu, add_bias_linear=True
    )
    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="LayerNorm"),
        vocab_size=spec.vocab_size, max_sequence_length=spec.seq_length,
        share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute",
    )


def save_world(rank: int, world: int, spec, root: str) -> dict:
    """Write both checkpoints under `root`; returns the description the defaults model records."""
    from megatron.core import dist_checkpointing
    from persistence_worker import lora_config, setup

    from megatron_lora_patch.lora import inventory
    from megatron_lora_patch.lora.checkpoints import checkpoint
    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.topology import Topology

    setup(lora_config(seed=3))
    topology = Topology.parse("tp1")
    with topology.world():
        model = _megatron_defaults_gpt(spec, topology)
        checkpoint.save_adapters([model], os.path.join(root, DEFAULTS))
        chunks = build_model(spec, topology)
        state = checkpoint.adapter_only_sharded_state_dict(chunks)
        description = inventory.describe(chunks)
        state[checkpoint.DESCRIPTION_KEY] = {k: v for k, v in description.items() if k not in inventory.FIELDS}
        os.makedirs(os.path.join(root, OLDER))
        dist_checkpointing.save(state, os.path.join(root, OLDER))
        return inventory.describe([model])
