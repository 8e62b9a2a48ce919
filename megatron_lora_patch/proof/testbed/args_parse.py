"""Megatron-LM's own argument parser and `validate_args` on the user's `pretrain_gpt.py` arguments, as
`pretrain_gpt.py` runs them but without initializing distributed (docs/fail-closed.md, "preflight"): every
refusal is one `UsageError` line before any rank starts, and the parser must be Megatron-LM 0.17 or newer
(the one megatron-core ships from 0.17, or a source tree of that age first on the path)."""

from __future__ import annotations

import argparse
import contextlib
import io
import pathlib
import re
import sys
from typing import Any, Callable, Optional, Sequence, Tuple

from megatron_lora_patch.proof.testbed.args_check import failure_reason, rejection
from megatron_lora_patch.runtime.errors import UsageError

#: The oldest Megatron-LM whose training arguments the preflight reads (megatron-core ships them from 0.17).
OLDEST_TRAINING = (0, 17)
_VERSION_FIELD = re.compile(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", re.M)


def check_training_version(arguments_file: str) -> None:
    """Refuse a `megatron.training` older than Megatron-LM 0.17 (a source tree first on the path), whose
    parser and `validate_args` differ: one line naming the tree, its version and the fix."""
    root = pathlib.Path(arguments_file).resolve().parents[2]  # <root>/megatron/training/arguments.py
    version = tree_version(root)
    if version is not None and version < OLDEST_TRAINING:
        found = ".".join(map(str, version))
        raise UsageError(
            f"preflight needs Megatron-LM 0.17 or newer, but megatron.training comes from {root} ({found}); "
            "update that tree, or take it off PYTHONPATH to use the megatron.training of megatron-core >= 0.17"
        )


def tree_version(root: pathlib.Path) -> Optional[Tuple[int, ...]]:
    """(major, minor, patch) of the Megatron tree at `root` (megatron/core/package_info.py), None if unreadable."""
    try:
        text = (root / "megatron" / "core" / "package_info.py").read_text()
    except OSError:
        return None
    fields = dict(_VERSION_FIELD.findall(text))
    if not {"MAJOR", "MINOR"} <= set(fields):
        return None
    return tuple(int(fields.get(name, 0)) for name in ("MAJOR", "MINOR", "PATCH"))


def refuse_fsdp(args: argparse.Namespace) -> None:
    """A fully sharded wrapper is refused as the user's run would refuse it (`lora.layers.unsupported`), before
    Megatron-LM's own checks of the FSDP arguments (CUDA_DEVICE_MAX_CONNECTIONS, which the preflight sets to 1)."""
    from megatron_lora_patch.lora.layers.unsupported import fsdp_flag, sharded_data_parallel_problem

    flag = fsdp_flag(args)
    if flag:
        raise UsageError(sharded_data_parallel_problem(flag, f"leave out {flag}"))


def parse_megatron_args(argv: Sequence[str], topology_of: Callable[[argparse.Namespace], Any]) -> argparse.Namespace:
    """Megatron-LM's `parse_args` + `validate_args` on `argv`, for the world `topology_of(args)` describes.

    An unknown argument is refused as `pretrain_gpt.py` refuses it. A rejected
    argument is one UsageError line; nothing distributed is initialized.
    """
    try:
        from megatron.training import arguments
    except ImportError as error:
        raise UsageError(
            f"preflight needs Megatron-LM's argument parser (megatron.training, in megatron-core >= 0.17): {error}"
        ) from None
    check_training_version(arguments.__file__)
    saved_argv, captured, parsers = sys.argv, io.StringIO(), []
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        with contextlib.redirect_stderr(captured):
            args = arguments.parse_args(lambda parser: parsers.append(parser) or parser)
    except SystemExit:
        lines = [line for line in captured.getvalue().splitlines() if line.strip()]
        raise UsageError(rejection(lines[-1] if lines else "bad arguments", parsers)) from None
    finally:
        sys.argv = saved_argv
    refuse_fsdp(args)
    topology = topology_of(args)
    args.world_size, args.rank = topology.world_size, 0
    with _cpu_host(arguments), contextlib.redirect_stdout(io.StringIO()):
        try:
            arguments.validate_args(args, {})
        except (AssertionError, ValueError, TypeError) as error:
            raise UsageError(f"Megatron-LM rejects the arguments: {failure_reason(error)}") from None
    return args


@contextlib.contextmanager
def _cpu_host(arguments_module):
    """On a machine without CUDA, answer `validate_args`' GPU questions as a pre-Blackwell GPU would."""
    import os

    import torch

    from megatron_lora_patch.runtime.patching import Patcher

    patcher = Patcher()
    saved = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if not torch.cuda.is_available():
        if hasattr(arguments_module, "get_device_arch_version"):
            patcher.replace(arguments_module, "get_device_arch_version", lambda: 0)
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    try:
        yield
    finally:
        patcher.revert()
        if saved is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        else:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = saved
