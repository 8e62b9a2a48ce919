"""What the plugin adds to every Megatron distributed checkpoint it saves or loads.

The `lora_checkpoint` patch wraps `megatron.core.dist_checkpointing.save` / `load`, the
entry points Megatron-LM's `save_checkpoint` / `load_checkpoint` and `save_adapters` /
`load_adapters` all go through:

- **save**: a state that holds adapter tensors also gets the plugin's description (rank,
  alpha, targets, layout and the model shape, `inventory.describe`) in its common state,
  so `megatron-lora-patch export` needs no flags for any checkpoint the plugin wrote; a
  Megatron-LM training checkpoint leaves the frozen base out (`workflow.trim_save`).
- **load from a base checkpoint** (no adapter tensors in it, e.g. pretrained without the
  plugin, `--load BASE --finetune` or `--pretrained-checkpoint BASE`): the adapter entries
  are taken out of the request before Megatron plans the load, at any strictness, so
  neither the load plan ("... lora.A from model not in state dict") nor the non-strict
  factory merge (SwiGLU fc1 `lora.B`) sees them; the base loads bitwise as saved, the
  adapters keep their topology-invariant init (DoRA's `m` is set from the loaded base,
  `magnitudes.py`), and one INFO line says so.
- **load from a checkpoint with adapters**: Megatron restores them (resharded by the
  `lora_checkpoint` sharding); when they do not match this run's adapters (rank, targets)
  the load stops with one line naming both.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Dict, Iterator, List, Tuple

from megatron_lora_patch.lora import inventory
from megatron_lora_patch.lora.checkpoints import checkpoint, magnitudes, workflow
from megatron_lora_patch.lora.layers import attach
from megatron_lora_patch.runtime.errors import UsageError

logger = logging.getLogger(__name__)

_OPTIMIZER_PREFIX = "optimizer"


class AdapterMismatchError(UsageError):
    """A checkpoint's adapters do not fit this run's (one line naming both)."""


def _adapter_slots(state: Any, path: Tuple = ()) -> Iterator[Tuple[Tuple, Any]]:
    """`(path of dict keys, entry)` of every adapter ShardedTensor / factory in a nested state dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(state, dict):
        for key, value in state.items():
            if isinstance(value, (ShardedTensor, ShardedTensorFactory)):
                if checkpoint.is_adapter_key(value.key):
                    yield path + (key,), value
            elif isinstance(value, dict):
                yield from _adapter_slots(value, path + (key,))


def _is_optimizer(path: Tuple, key: str) -> bool:
    return str(path[0]).startswith(_OPTIMIZER_PREFIX) or key.startswith(_OPTIMIZER_PREFIX + ".")


def _description_of(state: dict) -> Any:
    """The description of the remembered model whose adapter tensors `state` holds, else None."""
    held = {id(entry.data) for _, entry in _adapter_slots(state)}
    for model in attach.attached_models():
        if any(id(param) in held for param in model.parameters()):
            return inventory.describe([model])
    return None


def save_with_description(wrapped, instance, args, kwargs):
    """`dist_checkpointing.save` that records the adapter description in the common state."""
    state = args[0] if args else kwargs.get("sharded_state_dict")
    if isinstance(state, dict) and checkpoint.DESCRIPTION_KEY not in state:
        description = _description_of(state)
        if description is not None:
            state[checkpoint.DESCRIPTION_KEY] = description
            workflow.trim_save(state)
    return wrapped(*args, **kwargs)


def _summary(shapes: Dict[str, tuple]) -> str:
    """'rank 4 on linear_proj, linear_qkv' from stacked adapter keys and their global shapes."""
    ranks = sorted({shape[-2] for key, shape in shapes.items() if key.endswith(".A")})
    modules = sorted({_module_kind(key) for key in shapes})
    return f"rank {'/'.join(map(str, ranks))} on {', '.join(modules)}"


def _module_kind(key: str) -> str:
    return key.split(f".{checkpoint.ADAPTER_NAME}.")[0].rsplit(".", 1)[-1]


def check_match(requested: Dict[str, Any], saved: Dict[str, Any], directory: str) -> None:
    """Raise `AdapterMismatchError` unless this rank's adapter entries fit the saved ones.

    Compared: every requested key exists with the same global shape (the rank is in the
    shapes), and the checkpoint holds no adapter on a kind of module this run does not adapt.
    """
    have = {key: tuple(entry.global_shape) for key, entry in saved.items()}
    wanted = {key: tuple(getattr(entry, "global_shape", ())) for key, entry in requested.items()}
    kinds = {_module_kind(key) for key in wanted}
    missing = [key for key in wanted if key not in have]
    differs = [key for key, shape in wanted.items() if shape and key in have and have[key] != shape]
    extra = [key for key in have if _module_kind(key) not in kinds]
    if missing or differs or extra:
        raise AdapterMismatchError(
            f"the LoRA adapters in {directory} ({_summary(have)}) do not match this run's ({_summary(wanted)}); "
            "set MEGATRON_LORA_RANK and MEGATRON_LORA_TARGETS as when it was saved, "
            "or fine-tune from a base checkpoint without adapters"
        )


def check_shared_outer(here: Any, directory: str) -> None:
    """Raise `AdapterMismatchError` when the checkpoint's experts share their outer factors and this run's do
    not, or the other way round (the shapes agree: the shared factor is saved under every expert's name, and
    loading per-expert factors into one shared tensor would keep whichever expert came last)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(directory)
    saved = common.get(checkpoint.DESCRIPTION_KEY) if isinstance(common, dict) else None
    if not isinstance(here, dict) or not isinstance(saved, dict):
        return  # nothing to compare: a checkpoint written without the plugin's description, or no model known
    shared = bool(saved.get("expert_shared_outer", False))
    if shared != bool(here.get("expert_shared_outer", False)):
        raise AdapterMismatchError(
            f"the LoRA experts in {directory} {'share' if shared else 'do not share'} one fc1 A and fc2 B per "
            f"MoE layer, this run's {'do not' if shared else 'do'}; set MEGATRON_LORA_EXPERT_SHARED_OUTER="
            f"{int(shared)} as when it was saved"
        )


def _saved_adapters(directory: str) -> Dict[str, Any]:
    from megatron.core import dist_checkpointing

    from megatron_lora_patch.lora.checkpoints.source import is_model_adapter_key

    return {
        key: entry
        for key, entry in dist_checkpointing.load_tensors_metadata(directory).items()
        if is_model_adapter_key(key)
    }


def _put_back(loaded: dict, slots: List[Tuple[Tuple, Any]]) -> None:
    """The adapters left out of the load keep their current (initial) values in the result."""
    for path, entry in slots:
        container = loaded
        for key in path[:-1]:
            container = container.setdefault(key, {})
        container[path[-1]] = entry.data


def _announce_base(directory: str, count: int) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(
            "LoRA: %s holds no adapters (a base checkpoint): the base weights load as saved, "
            "the %d adapter tensors keep their initialization",
            directory,
            count,
        )


def load_base_or_adapters(wrapped, instance, args, kwargs):
    """`dist_checkpointing.load` that lets a base checkpoint load into a model with adapters."""
    call = inspect.signature(wrapped).bind(*args, **kwargs).arguments
    state, directory = call["sharded_state_dict"], str(call["checkpoint_dir"])
    slots = list(_adapter_slots(state))
    if not slots:
        return wrapped(*args, **kwargs)
    saved = _saved_adapters(directory)
    model_slots = [(path, entry) for path, entry in slots if not _is_optimizer(path, entry.key)]
    if saved:
        check_match({entry.key: entry for _, entry in model_slots}, saved, directory)
        check_shared_outer(_description_of(state), directory)
        return wrapped(*args, **kwargs)
    if len(model_slots) < len(slots):
        raise AdapterMismatchError(
            f"{directory} holds no LoRA adapters and no optimizer state for them; start from it with "
            "--finetune (or --pretrained-checkpoint), which loads the model only"
        )
    for path, _ in slots:
        container = state
        for key in path[:-1]:
            container = container[key]
        del container[path[-1]]
    result = wrapped(*args, **kwargs)
    loaded = result[0] if isinstance(result, tuple) else result
    _put_back(loaded, slots)
    magnitudes.set_from_loaded_base(loaded, slots, attach.attached_models())
    _announce_base(directory, len(slots))
    return result
