"""What Megatron-LM's `setup_model_and_optimizer` checks for a LoRA run, so that a mistake stops it with one
line before the first step and leaves every file as it was (docs/checkpoints.md section 4).

Before the model is built:
- `MEGATRON_LORA_FULL_CHECKPOINTS=1` against `--save-trainable-params-only` (else only the first save, after
  training, would meet the contradiction, and leave an empty `iter_*` directory behind);
- a `--pretrained-checkpoint` that holds no checkpoint (Megatron-LM raises without naming it when it would
  start from it, and ignores it when `--load` holds a checkpoint);
- for a run that builds adapters (`lora_linear` on), checkpoints this package cannot read or write
  (`check_checkpoint_formats`): a save in a format other than `torch_dist` (Megatron-LM's legacy `torch` format
  keeps the frozen base and a TP-bound layout; `torch_dcp` / `fsdp_dtensor` go with FSDP, refused on its own),
  `--non-persistent-ckpt-type local` (saved and loaded past Megatron's distributed checkpointing, where this
  package describes the adapters, leaves the frozen base out and checks the base it loads), and a base in
  `--load` / `--pretrained-checkpoint` written in the legacy `torch` format (what Megatron-LM's
  `tools/checkpoint/convert.py` writes by default): the base loader of a resume reads distributed checkpoints
  only, and Megatron-LM converts one in a single run (`--ckpt-convert-format torch_dist`).

After the load:
- a model with adapters whose frozen base no load filled (Megatron-LM only prints "will start from
  random"), unless `MEGATRON_LORA_ALLOW_RANDOM_BASE=1`;
- a `--save` directory that already holds a checkpoint this run did not resume from: Megatron-LM would write
  its iterations over it (re-running `--load BASE --finetune --save LORA_DIR` starts at iteration 1 again).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from megatron_lora_patch.lora.checkpoints.workflow import BASE_FIX, LOADED_BASE, BaseCheckpointError, full_checkpoints
from megatron_lora_patch.runtime.flags import ALLOW_RANDOM_BASE_VARIABLE, env_bool

#: The checkpoint format a LoRA run saves in, and the patch that builds the adapters.
DISTRIBUTED_FORMAT = "torch_dist"
LORA_LINEAR_PATCH = "lora_linear"


def _what_is_not_a_checkpoint(path: str, resuming: bool) -> Optional[str]:
    """Why `path` cannot be the base checkpoint Megatron-LM (or, on resume, the base loader) reads, or None."""
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint
    from megatron.training.checkpointing import checkpoint_exists, get_checkpoint_tracker_filename

    if checkpoint_exists(path):
        return None
    if not os.path.exists(path):
        return "does not exist"
    if not os.path.isdir(path):
        return "is a file, not a checkpoint directory"
    if check_is_distributed_checkpoint(path):
        parent = os.path.dirname(os.path.abspath(path))
        return None if resuming else f"is an iteration directory; Megatron-LM starts from its --save directory {parent}"
    return f"holds no checkpoint (no {os.path.basename(get_checkpoint_tracker_filename(path))})"


def check_pretrained(args: Any) -> None:
    """Refuse a `--pretrained-checkpoint` that holds no checkpoint, in one line naming it."""
    from megatron.training.checkpointing import checkpoint_exists

    given = getattr(args, "pretrained_checkpoint", None)
    if not given:
        return
    problem = _what_is_not_a_checkpoint(given, resuming=checkpoint_exists(args.load))
    if problem:
        raise BaseCheckpointError(
            f"--pretrained-checkpoint {given} {problem}; pass the directory the base checkpoint was saved to (--save)"
        )


def _tracked(directory: str) -> str:
    """What the tracker file of a `--save` directory holds (an iteration or "release"), read as text on this rank:
    Megatron-LM's `read_metadata` is a collective that exits on a garbled file."""
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    with open(get_checkpoint_tracker_filename(directory)) as handle:
        return handle.read().strip()


def _adapters_requested() -> bool:
    """Whether the models this run builds get adapters (the `lora_linear` patch is on)."""
    from megatron_lora_patch.runtime import registry

    return any(row.patch == LORA_LINEAR_PATCH and row.enabled for row in registry.status())


def _legacy_iteration(path: Optional[str]) -> Optional[str]:
    """The iteration directory of the torch-format (legacy) checkpoint `path` holds, or None."""
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint
    from megatron.training.checkpointing import checkpoint_exists, get_checkpoint_name

    if not path or not checkpoint_exists(path):
        return None
    latest = _tracked(path)
    release = latest == "release"
    if not release and not latest.isdigit():
        return None  # Megatron-LM names the garbled tracker itself
    iteration = get_checkpoint_name(path, 0 if release else int(latest), release=release, return_base_dir=True)
    return iteration if os.path.isdir(iteration) and not check_is_distributed_checkpoint(iteration) else None


def check_checkpoint_formats(args: Any) -> None:
    """Refuse, in one line, checkpoint settings a LoRA run cannot save or load its adapters by (module docstring)."""
    if args.save and args.ckpt_format != DISTRIBUTED_FORMAT:
        raise BaseCheckpointError(
            f"--ckpt-format {args.ckpt_format} cannot save a LoRA run: its checkpoints are distributed ones, "
            f"adapter-sized and loadable on any topology; pass --ckpt-format {DISTRIBUTED_FORMAT} (the default)"
        )
    if getattr(args, "non_persistent_ckpt_type", None) == "local":
        raise BaseCheckpointError(
            "--non-persistent-ckpt-type local is not supported for a LoRA run: its checkpoints bypass Megatron's "
            "distributed checkpointing, where the adapters are described and the frozen base left out; leave it out "
            "and save with --save"
        )
    for flag, path in (("--load", args.load), ("--pretrained-checkpoint", args.pretrained_checkpoint)):
        legacy = _legacy_iteration(path)
        if legacy:
            raise BaseCheckpointError(
                f"{flag} {path} holds a torch-format checkpoint ({legacy}), which a LoRA run cannot take its base "
                f"from; convert it once without MEGATRON_PLUGINS (your model's arguments and --load {path} "
                f"--ckpt-format torch --ckpt-convert-format {DISTRIBUTED_FORMAT} --ckpt-convert-save NEW_DIR) and "
                f"pass NEW_DIR/{DISTRIBUTED_FORMAT}"
            )


def _require_loaded_base(args: Any) -> None:
    """A model with adapters whose frozen base was never loaded stops the run, unless tests allow it."""
    if LOADED_BASE or env_bool(ALLOW_RANDOM_BASE_VARIABLE):
        return
    named = args.load or args.pretrained_checkpoint
    why = f"no checkpoint was found in {named}" if named else "neither --load nor --pretrained-checkpoint is given"
    raise BaseCheckpointError(
        f"LoRA would train on a randomly initialised base: {why}; {BASE_FIX}, "
        f"or set {ALLOW_RANDOM_BASE_VARIABLE}=1 to train on a random base on purpose (tests)"
    )


def _same_directory(path: Optional[str], other: str) -> bool:
    return bool(path) and os.path.isdir(path) and os.path.samefile(path, other)


def _resumed_from(args: Any, save: str, latest: str) -> bool:
    """Whether this run loaded the checkpoint of iteration `latest` from `save` and continues from it."""
    return _same_directory(args.load, save) and not args.finetune and str(args.iteration) == latest


def _base_argument(args: Any, save: str) -> str:
    """The base directory this run was given, for the resume command of a refusal (BASE_DIR if unknown)."""
    if args.pretrained_checkpoint:
        return args.pretrained_checkpoint
    if args.finetune and args.load and not _same_directory(args.load, save):
        return args.load
    return "BASE_DIR"


def check_save_directory(args: Any) -> None:
    """Refuse a `--save` directory that holds a checkpoint this run did not resume from (one line naming how to
    resume it and how to start over); Megatron-LM would overwrite its iterations."""
    from megatron.training.checkpointing import checkpoint_exists

    save = args.save
    if not checkpoint_exists(save):
        return
    latest = _tracked(save)
    if _resumed_from(args, save, latest):
        return
    resume = f"--pretrained-checkpoint {_base_argument(args, save)} --load {save}"
    raise BaseCheckpointError(
        f"--save {save} already holds the checkpoint of iteration {latest}, which this run (starting at iteration "
        f"{args.iteration + 1}) would overwrite; to resume it pass {resume}, to start over pass a new --save directory"
    )


def setup_model_and_optimizer(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Megatron-LM's `setup_model_and_optimizer` with the checks above around it."""
    from megatron.training.global_vars import get_args

    from megatron_lora_patch.lora.layers import attach

    given = get_args()
    full_checkpoints(given)
    check_pretrained(given)
    if _adapters_requested():
        check_checkpoint_formats(given)
    result = wrapped(*args, **kwargs)
    if attach.attached_models():
        _require_loaded_base(given)
        check_save_directory(given)
    return result
