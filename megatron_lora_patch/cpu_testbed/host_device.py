"""Let Megatron's "current CUDA device" mean the CPU.

Megatron allocates with `device=torch.cuda.current_device()`, literal `device="cuda"`
and `.cuda()`, and synchronizes streams around P2P and MoE token counts. On a CPU-only
build every one of those calls raises, so replacing them cannot change anything that
works there. This module replaces, for as long as the patch is applied:

- `torch.cuda.current_device()` -> `torch.device("cpu")` (global: the call sites are
  spread over ~40 Megatron modules that all read it through the `torch` module);
- `torch.cuda.synchronize()` -> no-op (CPU ops are synchronous);
- `torch.cuda` seeding and RNG state, random factories given a CUDA device, and dropout on
  activations outside a tracker fork -> the host's own "CUDA generator"
  (`cpu_testbed.device_rng`), separate from the CPU generator;
- `torch.cuda.Stream` / `current_stream` / `stream` -> a host stream whose events are
  always complete (MoE dispatcher and DDP create side streams);
- a `TorchFunctionMode` that maps a CUDA `device=` argument to the CPU and makes
  `Tensor.cuda()` return the tensor itself (what `.cuda()` does for a tensor already on
  the target device). The mode is pushed on the applying thread's mode stack and popped
  on revert; pushing another mode in between and leaving it there makes revert fail loudly.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_lora_patch.cpu_testbed import device_rng

_HOST = torch.device("cpu")


def host_current_device() -> torch.device:
    """Replacement of `torch.cuda.current_device`: allocations land on the CPU."""
    return _HOST


def host_synchronize(device: Any = None) -> None:
    """Replacement of `torch.cuda.synchronize`: CPU kernels finish before they return."""


class HostEvent:
    """A CUDA event stand-in that has always completed."""

    def synchronize(self) -> None:
        """Nothing to wait for on the host."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for on the host."""

    def query(self) -> bool:
        return True

    def record(self, stream: Any = None) -> None:
        """Recording on the host is a no-op."""


class HostStream:
    """A CUDA stream stand-in: work is already ordered on the host, so every method is a no-op."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = _HOST

    def wait_stream(self, stream: Any) -> None:
        """Host work is already ordered."""

    def wait_event(self, event: Any) -> None:
        """Host work is already ordered."""

    def record_event(self, event: Any = None) -> HostEvent:
        return event if event is not None else HostEvent()

    def synchronize(self) -> None:
        """Nothing to wait for on the host."""

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = HostStream()


def host_current_stream(device: Any = None) -> HostStream:
    """Replacement of `torch.cuda.current_stream` (and `default_stream`)."""
    return _DEFAULT_STREAM


def host_stream(stream: Any = None) -> contextlib.AbstractContextManager:
    """Replacement of the `torch.cuda.stream(...)` context manager."""
    return contextlib.nullcontext()


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.split(":")[0] == "cuda"


class HostDeviceMode(TorchFunctionMode):
    """Maps CUDA device arguments to the CPU, drops `pin_memory`; `Tensor.cuda()` returns the tensor
    itself and `Tensor.type()` names the CUDA type.

    Only the device changes, never dtype or values, so numerics are untouched.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # A type query ("torch.BFloat16Tensor"): answer as the CUDA device would, since the
            # host plays that device (Megatron's Float16 optimizer accepts only CUDA type names).
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs = device_rng.route_random_factory(func, {**kwargs, "device": _HOST})
        if kwargs.get("pin_memory"):  # a transfer hint that needs an accelerator (RoPE's CP index)
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _HOST, *args[2:])
        if device_rng.routes_to_device(func):
            return device_rng.draw_on_device(func, args, kwargs)
        return func(*args, **kwargs)


_CUDA_REPLACEMENTS = {
    "current_device": host_current_device,
    "synchronize": host_synchronize,
    "Stream": HostStream,
    "current_stream": host_current_stream,
    "default_stream": host_current_stream,
    "stream": host_stream,
    "manual_seed": device_rng.manual_seed,
    "manual_seed_all": device_rng.manual_seed,
    "get_rng_state": device_rng.get_rng_state,
    "set_rng_state": device_rng.set_rng_state,
}


def install(patcher) -> None:
    """Replace the `torch.cuda` entry points above and push `HostDeviceMode` (undone on revert)."""
    for name, replacement in _CUDA_REPLACEMENTS.items():
        patcher.replace(torch.cuda, name, replacement)
    mode = HostDeviceMode()
    mode.__enter__()
    patcher.on_revert(lambda: _pop_exactly(mode))


def _pop_exactly(mode: HostDeviceMode) -> None:
    stack = torch.overrides._get_current_function_mode_stack()
    if not stack or stack[-1] is not mode:
        raise RuntimeError(
            "cpu_compat revert: another TorchFunctionMode was pushed after cpu_compat's "
            "HostDeviceMode and is still active; exit it before reverting the patch"
        )
    mode.__exit__(None, None, None)


def recompute_under_host_mode(wrapped, instance, args, kwargs):
    """Megatron's activation checkpointing re-runs the forward during backward. torch pops
    function modes while it dispatches `backward`, so without this the recomputed forward
    (e.g. `get_default_causal_mask`'s `device="cuda"`) would run unmapped."""
    with HostDeviceMode():
        return wrapped(*args, **kwargs)


def install_recompute(patcher, random_module) -> None:
    """Recompute paths of `tensor_parallel.random`: full (CheckpointFunction.backward) and
    selective (CheckpointWithoutOutput._recompute)."""
    patcher.wrap(random_module.CheckpointFunction, "backward", recompute_under_host_mode)
    patcher.wrap(random_module.CheckpointWithoutOutput, "_recompute", recompute_under_host_mode)

