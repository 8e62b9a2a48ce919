"""Megatron-LM checkpoints of a LoRA run: adapter-sized on save, the base completed on load
(docs/checkpoints.md); the run's own checks before its first step are `guards`.

- **save** (`trim_save`, from the `dist_checkpointing.save` wrapper): a Megatron-LM training
  checkpoint (its state carries `args` and `checkpoint_version`) of a model with adapters
  leaves out every frozen parameter of its model sections, as Megatron-LM PR #7280's
  `--save-trainable-params-only` does (the adapters, what `modules_to_save` trains, the optimizer
  state, iteration, scheduler and RNG stay, under Megatron's own keys). The directory the base
  was loaded from is recorded beside them (`BASE_KEY`). `MEGATRON_LORA_FULL_CHECKPOINTS=1` keeps
  full checkpoints.
- **load** (`load_with_base`): frozen parameters a checkpoint does not hold (an adapter-only
  checkpoint, ours or #7280's) are read from the base: `--pretrained-checkpoint` when given (it must
  be the recorded base while that exists), else the recorded base directory. Without either the load
  stops with one line, and so does a base whose tensors have other shapes than the model's.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_lora_patch.runtime.errors import UsageError
from megatron_lora_patch.runtime.flags import FULL_CHECKPOINTS_VARIABLE, env_bool

logger = logging.getLogger(__name__)

#: Common-state entry of an adapter-only Megatron-LM checkpoint: where its base weights are.
BASE_KEY = "megatron_lora_patch_base"
BASE_FIX = "pass --pretrained-checkpoint BASE_DIR (or --load BASE_DIR --finetune)"
#: Directories the frozen base of this process was loaded from (empty: the base was never loaded).
LOADED_BASE: List[str] = []


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
    state[BASE_KEY] = {"path": LOADED_BASE[-1] if LOADED_BASE else None, "frozen_tensors_left_out": len(slots)}


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


def base_directory(directory: str, recorded: Optional[str]) -> Optional[str]:
    """The distributed checkpoint to read the base of `directory` (whose recorded base is `recorded`) from:
    --pretrained-checkpoint when given (refused when the recorded base exists and is another checkpoint), else
    the recorded base; None when neither exists."""
    from megatron_lora_patch.lora.checkpoints.source import resolve

    given = _pretrained_dir()
    recorded = recorded if recorded and os.path.isdir(recorded) else None
    if given:
        base = resolve(given)  # guards.check_pretrained made sure it is a checkpoint
        if recorded and not os.path.samefile(base, recorded):
            named = given if base == given else f"{given} ({base})"
            raise BaseCheckpointError(
                f"--pretrained-checkpoint {named} is not the base {directory} was trained on ({recorded}, recorded "
                f"in the checkpoint); pass --pretrained-checkpoint {recorded} or leave it out"
            )
        return base
    return resolve(recorded) if recorded else None


def _missing_base_error(directory: str, count: int, wanted: Optional[str]) -> BaseCheckpointError:
    where = f"the recorded base {wanted} does not exist" if wanted else "no base directory is recorded"
    return BaseCheckpointError(
        f"{directory} holds the LoRA adapters but not the {count} frozen base tensors, and {where}; {BASE_FIX}"
    )


def _check_shapes(slots: List[Tuple[Tuple, Any]], held: Dict[str, Any], directory: str) -> None:
    """Raise one line when `directory` (its tensor metadata `held`) holds a tensor of `slots` in another global
    shape than this model's (another --hidden-size, --num-layers, ...): Megatron's loader would fail deep in
    torch.distributed.checkpoint. Factories (SwiGLU fc1) are left out: fc2 beside them has the same sizes."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    differs = [
        (entry.key, tuple(held[entry.key].global_shape), tuple(entry.global_shape))
        for _, entry in slots
        if isinstance(entry, ShardedTensor) and entry.key in held
        and tuple(held[entry.key].global_shape) != tuple(entry.global_shape)
    ]
    if differs:
        key, saved, here = differs[0]
        raise BaseCheckpointError(
            f"the base weights in {directory} do not fit this model: {key} has shape {saved} there but {here} "
            f"here ({len(differs)} tensors differ); build the model with the arguments the base was saved with "
            "(--hidden-size, --num-layers, ...)"
        )


def _check_base(slots: List[Tuple[Tuple, Any]], base: str, directory: str) -> None:
    """The base checkpoint `base` holds every tensor of `slots`, in this model's shapes."""
    from megatron.core import dist_checkpointing

    held = dist_checkpointing.load_tensors_metadata(base)
    absent = sorted({entry.key for _, entry in slots if entry.key not in held})
    if absent:
        raise BaseCheckpointError(
            f"the base {base} of {directory} lacks {absent[0]} ({len(absent)} tensors); it is not the base the "
            f"adapters were trained on; {BASE_FIX}"
        )
    _check_shapes(slots, held, base)


def _read_base(wrapped: Any, slots: List[Tuple[Tuple, Any]], base: str) -> Dict[Tuple, Any]:
    """The frozen tensors of `slots` read from the base checkpoint `base` (Megatron's own load, resharded)."""
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
    _check_shapes(slots, held, directory)
    if not missing:
        result = load(wrapped, instance, args, kwargs)
        LOADED_BASE.append(os.path.abspath(directory))
        return result
    recorded, count = _recorded_base(directory), len({entry.key for _, entry in missing})
    base = base_directory(directory, recorded)
    if base is None:
        raise _missing_base_error(directory, count, _pretrained_dir() or recorded)
    _check_base(missing, base, directory)
    for path, _ in missing:
        _pop(state, path)
    result = load(wrapped, instance, args, kwargs)
    loaded = result[0] if isinstance(result, tuple) else result
    for path, value in _read_base(wrapped, missing, base).items():
        _place(loaded, path, value)
    LOADED_BASE.append(os.path.abspath(base))
    _announce(directory, base, count, recorded)
    return result


def _announce(directory: str, base: str, count: int, recorded: Optional[str]) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        moved = f" (the recorded base {recorded} no longer exists)" if recorded and not os.path.isdir(recorded) else ""
        logger.info(
            "LoRA: %s is adapter-only: its %d frozen base tensors load from %s%s", directory, count, base, moved
        )
