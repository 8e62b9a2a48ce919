"""Megatron-LM checkpoints of a LoRA run: adapter-sized on save, the base completed on load,
and no training on a base that never loaded (docs/checkpoints.md).

- **save** (`trim_save`, from the `dist_checkpointing.save` wrapper): a Megatron-LM training
  checkpoint (its state carries `args` and `checkpoint_version`) of a model with adapters
  leaves out every frozen parameter of its model sections, as Megatron-LM PR #7280's
  `--save-trainable-params-only` does (the adapters, what `modules_to_save` trains, the optimizer
  state, iteration, scheduler and RNG stay, under Megatron's own keys). The directory the base
  was loaded from is recorded beside them (`BASE_KEY`). `MEGATRON_LORA_FULL_CHECKPOINTS=1` keeps
  full checkpoints.
- **load** (`load_with_base`): frozen parameters a checkpoint does not hold (an adapter-only
  checkpoint, ours or #7280's) are read from the base: `--pretrained-checkpoint` when given, else
  the recorded base directory. Without either the load stops with one line.
- **guard** (`require_loaded_base`, after Megatron-LM's `setup_model_and_optimizer`): a LoRA
  run whose frozen base was never loaded (no `--load` / `--pretrained-checkpoint`, or a directory
  without a checkpoint: Megatron only prints "will start from random") stops with one line;
  `MEGATRON_LORA_ALLOW_RANDOM_BASE=1` lets tests train on a random base.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_lora_patch.runtime.errors import UsageError
from megatron_lora_patch.runtime.flags import ALLOW_RANDOM_BASE_VARIABLE, FULL_CHECKPOINTS_VARIABLE, env_bool

logger = logging.getLogger(__name__)

#: Common-state entry of an adapter-only Megatron-LM checkpoint: where its base weights are.
BASE_KEY = "megatron_lora_patch_base"
_FIX = "pass --pretrained-checkpoint BASE_DIR (or --load BASE_DIR --finetune)"
#: Directories the frozen base of this process was loaded from (empty: the base was never loaded).
_LOADED_BASE: List[str] = []


class BaseCheckpointError(UsageError):
    """The frozen base of a LoRA run is not (or cannot be) loaded (one line naming the fix)."""


def _frozen(entry: Any) -> bool:
    data = getattr(entry, "data", None)
    return isinstance(data, torch.nn.Parameter) and not data.requires_grad


def _is_model_section(key: Any) -> bool:
    return isinstance(key, str) and (key == "model" or (key.startswith("model") and key[5:].isdigit()))


def frozen_slots(state: dict) -> Iterator[Tuple[Tuple, Any]]:
    """`(path, entry)` of every frozen parameter's ShardedTensor / factory in the model sections of `state`."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def walk(node: dict, path: Tuple) -> Iterator[Tuple[Tuple, Any]]:
        for key, value in node.items():
            if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and _frozen(value):
                yield path + (key,), value
            elif isinstance(value, dict):
                yield from walk(value, path + (key,))

    for section, value in state.items():
        if _is_model_section(section) and isinstance(value, dict):
            yield from walk(value, (section,))


def _pop(state: dict, path: Tuple) -> Any:
    container = state
    for key in path[:-1]:
        container = container[key]
    return container.pop(path[-1])


def _place(state: dict, path: Tuple, value: Any) -> None:
    container = state
    for key in path[:-1]:
        container = container.setdefault(key, {})
    container[path[-1]] = value


def _asked_trainable_only(args: Any) -> bool:
    """`--save-trainable-params-only` (Megatron-LM PR #7280; accepted here as a synonym of the default)."""
    return bool(getattr(args, "save_trainable_params_only", False))


def full_checkpoints(args: Any = None) -> bool:
    """Whether this run keeps full checkpoints (`MEGATRON_LORA_FULL_CHECKPOINTS=1`); refuses a contradiction."""
    full = bool(env_bool(FULL_CHECKPOINTS_VARIABLE))
    if full and _asked_trainable_only(args):
        raise BaseCheckpointError(
            f"{FULL_CHECKPOINTS_VARIABLE}=1 keeps full checkpoints but --save-trainable-params-only asks for "
            "adapter-only ones; drop one of them"
        )
    return full


def is_training_checkpoint(state: Any) -> bool:
    """A state dict built by Megatron-LM's `generate_state_dict` (a `--save` checkpoint)."""
    return isinstance(state, dict) and "checkpoint_version" in state and "args" in state


def trim_save(state: dict) -> None:
    """Leave the frozen parameters out of a Megatron-LM checkpoint of a LoRA model (in place) and record
    its base directory; a no-op for full checkpoints."""
    if not is_training_checkpoint(state) or full_checkpoints(state["args"]):
        return
    slots = list(frozen_slots(state))
    for path, _ in slots:
        _pop(state, path)
    state[BASE_KEY] = {"path": _LOADED_BASE[-1] if _LOADED_BASE else None, "frozen_tensors_left_out": len(slots)}


def _pretrained_dir() -> Optional[str]:
    """`--pretrained-checkpoint` of this Megatron-LM run, if any."""
    try:
        from megatron.training.global_vars import get_args

        return getattr(get_args(), "pretrained_checkpoint", None)
    except (ImportError, AssertionError):  # no Megatron-LM, or its arguments are not parsed
        return None


def _recorded_base(directory: str) -> Optional[str]:
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(directory)
    recorded = common.get(BASE_KEY) if isinstance(common, dict) else None
    return recorded.get("path") if isinstance(recorded, dict) else None


def base_directory(directory: str) -> Optional[str]:
    """The distributed checkpoint to read the base from for `directory`: --pretrained-checkpoint, else the
    recorded base; None when neither exists."""
    from megatron_lora_patch.lora.checkpoints.source import resolve

    for candidate in (_pretrained_dir(), _recorded_base(directory)):
        if candidate and os.path.isdir(candidate):
            return resolve(candidate)
    return None


def _missing_base_error(directory: str, count: int, wanted: Optional[str]) -> BaseCheckpointError:
    where = f"the recorded base {wanted} does not exist" if wanted else "no base directory is recorded"
    return BaseCheckpointError(
        f"{directory} holds the LoRA adapters but not the {count} frozen base tensors, and {where}; {_FIX}"
    )


def _read_base(wrapped: Any, slots: List[Tuple[Tuple, Any]], base: str, directory: str) -> Dict[Tuple, Any]:
    """The frozen tensors of `slots` read from the base checkpoint `base` (Megatron's own load, resharded)."""
    from megatron.core import dist_checkpointing

    held = dist_checkpointing.load_tensors_metadata(base)
    absent = sorted({entry.key for _, entry in slots if entry.key not in held})
    if absent:
        raise BaseCheckpointError(
            f"the base {base} of {directory} lacks {absent[0]} ({len(absent)} tensors); it is not the base the "
            f"adapters were trained on; {_FIX}"
        )
    request = {str(index): entry for index, (_, entry) in enumerate(slots)}
    loaded = wrapped(request, base)
    loaded = loaded[0] if isinstance(loaded, tuple) else loaded
    return {path: loaded[str(index)] for index, (path, _) in enumerate(slots)}


def load_with_base(wrapped: Any, instance: Any, args: tuple, kwargs: dict, load: Any) -> Any:
    """`dist_checkpointing.load` (`load` is the adapter-aware loader) that completes the frozen base of an
    adapter-only checkpoint from the base checkpoint, and notes where the base came from."""
    from megatron.core import dist_checkpointing

    call = inspect.signature(wrapped).bind(*args, **kwargs)
    state, directory = call.arguments["sharded_state_dict"], str(call.arguments["checkpoint_dir"])
    slots = list(frozen_slots(state)) if isinstance(state, dict) else []
    if not slots:
        return load(wrapped, instance, args, kwargs)
    held = dist_checkpointing.load_tensors_metadata(directory)
    missing = [(path, entry) for path, entry in slots if entry.key not in held]
    if not missing:
        result = load(wrapped, instance, args, kwargs)
        _LOADED_BASE.append(os.path.abspath(directory))
        return result
    base, count = base_directory(directory), len({entry.key for _, entry in missing})
    if base is None:
        raise _missing_base_error(directory, count, _pretrained_dir() or _recorded_base(directory))
    for path, _ in missing:
        _pop(state, path)
    result = load(wrapped, instance, args, kwargs)
    loaded = result[0] if isinstance(result, tuple) else result
    for path, value in _read_base(wrapped, missing, base, directory).items():
        _place(loaded, path, value)
    _LOADED_BASE.append(os.path.abspath(base))
    _announce(directory, base, count)
    return result


def _announce(directory: str, base: str, count: int) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("LoRA: %s is adapter-only: its %d frozen base tensors load from %s", directory, count, base)


def require_loaded_base(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Megatron-LM's `setup_model_and_optimizer`, then: a model with adapters whose frozen base was never
    loaded stops the run with one line (before the first step), unless MEGATRON_LORA_ALLOW_RANDOM_BASE=1."""
    from megatron_lora_patch.lora.layers import attach

    result = wrapped(*args, **kwargs)
    if _LOADED_BASE or not attach.attached_models() or env_bool(ALLOW_RANDOM_BASE_VARIABLE):
        return result
    from megatron.training.global_vars import get_args

    given = get_args()
    named = given.load or given.pretrained_checkpoint
    why = f"no checkpoint was found in {named}" if named else "neither --load nor --pretrained-checkpoint is given"
    raise BaseCheckpointError(
        f"LoRA would train on a randomly initialised base: {why}; {_FIX}, "
        f"or set {ALLOW_RANDOM_BASE_VARIABLE}=1 to train on a random base on purpose (tests)"
    )
