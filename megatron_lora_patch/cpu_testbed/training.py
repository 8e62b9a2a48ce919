"""Host fixes for Megatron-LM's training loop (`megatron.training`, in the megatron-core wheel
from 0.17): what stands between `pretrain()` and the optimizer step on CPU + gloo.

- S1 `pretrain()` calls `initialize_megatron` without `allow_no_cuda`, which then asserts
  CUDA: the host passes `allow_no_cuda=True`.
- S2 `initialize.py` sets up model parallelism and the model-parallel seeds only when
  `torch.cuda.device_count() > 0`, and selects the device: the host plays one device for
  those two calls (`set_device` is then a no-op; the process group stays gloo).
- S3 `fused_kernels.load(args)` (Megatron-LM checkouts) reads the nvcc version: nothing to build.
- S4 / S5 / S7 (CUDA RNG state in the rerun state machine and in checkpoints, CUDA draws of
  the JIT warm-up) are `cpu_testbed.device_rng`, installed with the host device.
- S6 `arguments.py` asks `get_device_arch_version()` (CUDA device properties) when TP or
  CP > 1: the host reports 0, an architecture without the Blackwell-only paths.
- The wheel ships the compiled dataset helpers but not their Makefile, and `pretrain()`
  runs `make` on rank 0: with the helpers importable there is nothing to compile.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Iterator

import torch

#: The architecture version the host reports (no Blackwell-only code paths).
HOST_DEVICE_ARCH_VERSION = 0


def _one_device() -> int:
    return 1


def _no_device_switch(device) -> None:
    """The host is the one device."""


@contextlib.contextmanager
def one_host_device() -> Iterator[None]:
    """For the duration: `torch.cuda.device_count()` is 1 and `set_device` a no-op."""
    saved = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count, torch.cuda.set_device = _one_device, _no_device_switch
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = saved


def allow_no_cuda(wrapped, instance, args, kwargs):
    """S1: `initialize_megatron(...)` with `allow_no_cuda=True`."""
    return wrapped(*args, **{**kwargs, "allow_no_cuda": True})


def on_one_host_device(wrapped, instance, args, kwargs):
    """S2: run an initialization step that is gated on a CUDA device count as on one device."""
    with one_host_device():
        return wrapped(*args, **kwargs)


def install_initialize(patcher, initialize) -> None:
    """S1 and S2 on `megatron.training.initialize` (and where its entry point was imported by name)."""
    patcher.wrap(
        initialize, "initialize_megatron", allow_no_cuda,
        reexported_by=("megatron.training.training", "megatron.training"),
    )
    for name in ("_initialize_distributed", "_set_random_seed"):
        patcher.wrap(initialize, name, on_one_host_device)


def host_device_arch_version() -> int:
    """S6: replacement of `get_device_arch_version` in `megatron.training.arguments`."""
    return HOST_DEVICE_ARCH_VERSION


def install_arguments(patcher, arguments) -> None:
    patcher.replace(arguments, "get_device_arch_version", host_device_arch_version)


def no_kernels_to_build(args) -> None:
    """S3: replacement of `megatron.legacy.fused_kernels.load`: the host has no CUDA kernels."""


def install_fused_kernels(patcher, fused_kernels) -> None:
    patcher.replace(fused_kernels, "load", no_kernels_to_build)


def compile_unless_prebuilt(wrapped, instance, args, kwargs):
    """`compile_helpers()` only where the compiled dataset helpers do not import."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return wrapped(*args, **kwargs)
    return None


def install_dataset_helpers(patcher, dataset_utils) -> None:
    patcher.wrap(dataset_utils, "compile_helpers", compile_unless_prebuilt)
