"""Find and read the adapter tensors of any checkpoint the plugin wrote.

Three kinds of directory hold them, all Megatron distributed checkpoints with the
plugin's description in their common state (`megatron_checkpoint` records it on save):

- an adapter-only checkpoint (`checkpoint.save_adapters`);
- an iteration directory of a Megatron-LM run (`--save DIR` writes `DIR/iter_0000004`);
- a Megatron-LM `--save` directory: the iteration its tracker file names, read with
  Megatron-LM's own reader (`megatron.training.checkpointing`, megatron-core >= 0.17).

Only the adapter tensors are read (the base weights and optimizer state stay on disk);
Megatron's loader returns them as full logical tensors, whatever topology saved them.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Dict, Iterator, Tuple

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_lora_patch.lora.checkpoints import checkpoint
from megatron_lora_patch.lora.layers import trained_fully
from megatron_lora_patch.runtime.errors import UsageError

_OPTIMIZER_PREFIX = "optimizer."


class CheckpointSourceError(UsageError, ValueError):
    """A directory is not a checkpoint with adapters (one line naming it and what to pass; a
    ValueError too, which the CLI reports as a usage error)."""


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """Megatron's checkpoint loader needs torch.distributed: a private 1-rank gloo group if none exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _latest_iteration(directory: str) -> str:
    """The iteration directory a Megatron-LM `--save` directory's tracker file names."""
    try:
        from megatron.training.checkpointing import (
            checkpoint_exists,
            get_checkpoint_name,
            get_checkpoint_tracker_filename,
            read_metadata,
        )
    except ImportError:
        raise CheckpointSourceError(
            f"{directory} is not a distributed checkpoint, and reading a Megatron-LM --save directory needs "
            "megatron.training (megatron-core >= 0.17); pass its iter_NNNNNNN directory instead"
        ) from None
    if not checkpoint_exists(directory):
        raise CheckpointSourceError(
            f"{directory} is not a Megatron distributed checkpoint (no metadata.json) nor a Megatron-LM "
            f"--save directory (no {os.path.basename(get_checkpoint_tracker_filename(directory))}); "
            "pass the directory given to --save, one of its iter_NNNNNNN directories, or an adapter checkpoint"
        )
    iteration, release = _read_tracker(read_metadata, get_checkpoint_tracker_filename(directory))
    return get_checkpoint_name(directory, iteration, release, return_base_dir=True)


def _read_tracker(read_metadata, tracker: str) -> Tuple[int, bool]:
    """Megatron-LM's `read_metadata` of `tracker`, whose refusal of a damaged file is `sys.exit()` (exit status 0)
    or an assertion: one line here instead, naming the file and what it holds (its own notice is not shown)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # "ERROR: Invalid metadata file ... Exiting"
            return read_metadata(tracker)
    except (SystemExit, AssertionError, OSError, UnicodeDecodeError):
        try:
            with open(tracker, errors="replace") as handle:
                held = repr(handle.read(64).strip())
        except OSError as error:
            held = f"unreadable: {error.strerror}"
        raise CheckpointSourceError(
            f"{tracker} names no checkpoint ({held}; Megatron-LM writes an iteration number or 'release'): pass one "
            f"of the iter_NNNNNNN directories beside it instead, or write the iteration to resume from into it"
        ) from None


def resolve(directory: str) -> str:
    """The distributed checkpoint `directory` stands for: itself, or its latest iteration."""
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint

    if check_is_distributed_checkpoint(directory):
        return directory
    return _latest_iteration(directory)


def resolve_save_dir(directory: str) -> str:
    """`directory`'s latest iteration when it is a Megatron-LM `--save` directory (it holds Megatron's
    tracker file), else `directory` itself (checked by the caller)."""
    if directory and os.path.isfile(os.path.join(directory, "latest_checkpointed_iteration.txt")):
        return _latest_iteration(directory)
    return directory


def is_model_adapter_key(key: str) -> bool:
    """A stacked model adapter tensor (not its optimizer state)."""
    return checkpoint.is_adapter_key(key) and not key.startswith(_OPTIMIZER_PREFIX)


def adapter_tensors(directory: str) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """(description, key -> full logical tensor) of the checkpoint `directory` stands for: the stacked
    adapter tensors and the fully trained weights its description lists (`modules_to_save`)."""
    from megatron.core import dist_checkpointing

    path = resolve(directory)
    with process_group():
        description = checkpoint.read_description(path)
        trained_keys = trained_fully.checkpoint_keys(description)
        wanted = {
            key: entry
            for key, entry in dist_checkpointing.load_tensors_metadata(path).items()
            if is_model_adapter_key(key) or key in trained_keys
        }
        if not any(map(is_model_adapter_key, wanted)):
            raise CheckpointSourceError(f"{path} holds no LoRA adapter tensors; export a checkpoint of a LoRA run")
        missing = sorted(set(trained_keys) - set(wanted))
        if missing:
            raise CheckpointSourceError(f"{path} lacks the fully trained weight {missing[0]} its description lists")
        try:
            loaded = dist_checkpointing.load(wanted, path, validate_access_integrity=False)
        except (CheckpointException, OSError, EOFError) as error:  # a truncated or damaged .distcp file
            raise CheckpointSourceError(checkpoint.unreadable_tensors(path, error)) from None
    return description, {key: loaded[key] for key in wanted}
