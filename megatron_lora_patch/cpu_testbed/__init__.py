"""Pieces of the `cpu_compat` patch: run Megatron-Core on CPU with gloo, numerics unchanged.

Each submodule fixes one kind of CUDA hard-code (see patches/cpu_compat.py for the map
from Megatron module to fix). Everything here is installed only through a `Patcher`,
so reverting the patch restores torch and Megatron exactly.
"""

from __future__ import annotations

from megatron_lora_patch.runtime import flags

#: Set to 1 to apply the CPU fixes even on a machine where CUDA is available (validated at activation).
FORCE_FLAG = flags.CPU_COMPAT_FORCE_VARIABLE


def host_is_cpu() -> bool:
    """True when the CPU fixes should take effect: no usable CUDA, or forced by `FORCE_FLAG`."""
    if flags.env_bool(FORCE_FLAG):
        return True
    import torch

    return not torch.cuda.is_available()


def host_only_hook(library: str, installer: str):
    """The `cpu_compat` hook for one Megatron module: `cpu_testbed.<library>.<installer>(patcher, module)`,
    skipped (reported, not an error) where CUDA is available and the fix is not forced."""

    def hook(patcher, module):
        import importlib

        from megatron_lora_patch.runtime.outcomes import SkipPatch

        if not host_is_cpu():
            raise SkipPatch(f"CUDA is available, nothing to fix (set {FORCE_FLAG}=1 to force)")
        getattr(importlib.import_module(f"{__name__}.{library}"), installer)(patcher, module)

    hook.__name__ = hook.__qualname__ = installer
    return hook
