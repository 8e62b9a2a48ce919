"""`lora_checkpoint`: adapters in Megatron distributed checkpoints with their true sharding.

`ColumnParallelLinear.sharded_state_dict` / `RowParallelLinear.sharded_state_dict` build
their entries from the layer's plain state dict, which includes the adapter's `lora.A` /
`lora.B` and marks both replicated over TP; half of them are TP shards. The wrapper
replaces those two entries with `megatron_lora_patch.lora.checkpoints.checkpoint.adapter_sharded_state_dict`
(sharded factor like the weight, SwiGLU fc1 B through Megatron's swiglu factory,
replicated factor with a TP replica id), so `dist_checkpointing.save` / `load` reshard
adapters across TP / EP / PP / DP. Layers without an adapter are untouched.

`megatron.core.dist_checkpointing.save` / `load` (what Megatron-LM's checkpointing calls):
a save records the adapter description, a load from a base checkpoint (no adapters)
keeps the adapters' init, a load of mismatched adapters stops with one line
(`megatron_lora_patch.lora.checkpoints.megatron`); a Megatron-LM training checkpoint of a
LoRA model is adapter-sized and its frozen base is read back from the base checkpoint
(`megatron_lora_patch.lora.checkpoints.workflow`, docs/checkpoints.md).

Megatron-LM (`megatron.training`): `setup_model_and_optimizer` stops a LoRA run before its first
step when its base never loaded, its `--save` directory holds a checkpoint it did not resume from, or
its checkpoint arguments contradict each other (`megatron_lora_patch.lora.checkpoints.guards`); the
argument parser accepts `--save-trainable-params-only` (Megatron-LM PR #7280) where the installed
Megatron-LM does not define it yet.
"""

from __future__ import annotations

from megatron_lora_patch.patches import tested_range
from megatron_lora_patch.runtime.patching import PatchSpec


def _sharded_state_dict(wrapped, instance, args, kwargs):
    # Imported on the first checkpoint, not when the patch applies (start-up cost).
    from megatron_lora_patch.lora.checkpoints.checkpoint import layer_sharded_state_dict

    return layer_sharded_state_dict(wrapped, instance, args, kwargs)


def _patch_layers(patcher, layers) -> None:
    patcher.wrap(layers.ColumnParallelLinear, "sharded_state_dict", _sharded_state_dict)
    patcher.wrap(layers.RowParallelLinear, "sharded_state_dict", _sharded_state_dict)


def _save(wrapped, instance, args, kwargs):
    from megatron_lora_patch.lora.checkpoints.megatron import save_with_description

    return save_with_description(wrapped, instance, args, kwargs)


def _load(wrapped, instance, args, kwargs):
    from megatron_lora_patch.lora.checkpoints.megatron import load_base_or_adapters
    from megatron_lora_patch.lora.checkpoints.workflow import load_with_base

    return load_with_base(wrapped, instance, args, kwargs, load_base_or_adapters)


def _patch_dist_checkpointing(patcher, dist_checkpointing) -> None:
    patcher.wrap(dist_checkpointing, "save", _save)
    patcher.wrap(dist_checkpointing, "load", _load)


def _setup_model_and_optimizer(wrapped, instance, args, kwargs):
    from megatron_lora_patch.lora.checkpoints.guards import setup_model_and_optimizer

    return setup_model_and_optimizer(wrapped, instance, args, kwargs)


def _patch_training(patcher, training) -> None:
    patcher.wrap(training, "setup_model_and_optimizer", _setup_model_and_optimizer)


_TRAINABLE_ONLY = "--save-trainable-params-only"


def _checkpointing_args(wrapped, instance, args, kwargs):
    parser = wrapped(*args, **kwargs)
    if _TRAINABLE_ONLY not in parser._option_string_actions:  # Megatron-LM without PR #7280
        parser.add_argument(
            _TRAINABLE_ONLY, action="store_true",
            help="save only trainable parameters (megatron-lora-patch: the default of a LoRA run)",
        )
    return parser


def _patch_arguments(patcher, arguments) -> None:
    patcher.wrap(arguments, "_add_checkpointing_args", _checkpointing_args)


SPEC = PatchSpec(
    name="lora_checkpoint",
    summary="LoRA adapters in dist checkpoints: sharded factor like the weight, replicated factor with TP replica ids",
    hooks={
        "megatron.core.tensor_parallel.layers": _patch_layers,
        "megatron.core.dist_checkpointing": _patch_dist_checkpointing,
        "megatron.training.training": _patch_training,
        "megatron.training.arguments": _patch_arguments,
    },
    versions=tested_range(),
    default=True,
)
