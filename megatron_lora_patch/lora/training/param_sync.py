"""Adapters take part in Megatron DDP's overlapped param all-gather (`--overlap-param-gather`).

With the distributed optimizer and `overlap_param_gather`, `optimizer.step()` updates only each DP rank's
shard of the params, and Megatron DDP gathers a bucket's params when a module using them next runs: it puts
a forward pre-hook on every module that waits for the all-gather of that module's OWN params
(`parameters(recurse=False)`) and dispatches the next bucket's. An adapter module's forward is never called
(its math runs inside its linear's call, lora/layers/linear.py), so those hooks never fire for the adapter
factors: the next step would read the factors before the other DP ranks' updates arrive. Measured without
this (tests/test_gpu_defaults_on_cpu.py, DP2): step 2's loss 5e-2 and the factor updates 0.5 off world
size 1 (relative).

The fix: each adapted linear carries a forward pre-hook that runs its adapter modules' forward pre-hooks as
calling them would. They are read when the linear runs, so hooks DDP adds after the adapters are attached
count and hooks it removes (`disable_forward_pre_hook`) do not.
"""

from __future__ import annotations

import torch

from megatron_lora_patch.lora.adapters.metadata import ADAPTER_NAME

#: Set on a linear once its pre-hook is registered (attaching again, after a merge, adds no second one).
HOOKED = "_lora_fires_adapter_pre_hooks"


def fire_adapter_pre_hooks(linear: torch.nn.Module) -> None:
    """Run the forward pre-hooks of `linear`'s adapter modules (the adapter, or a grouped layer's list and
    its adapters), as `module()` would run them, with no input."""
    adapters = linear._modules.get(ADAPTER_NAME)
    if adapters is None:  # merged away
        return
    for module in adapters.modules():
        for hook_id, hook in list(module._forward_pre_hooks.items()):
            if hook_id in module._forward_pre_hooks_with_kwargs:
                hook(module, (), {})
            else:
                hook(module, ())


def _pre_hook(linear: torch.nn.Module, args) -> None:
    fire_adapter_pre_hooks(linear)  # looked up at call time: the oracle's mutation replaces it


def hook_linear(linear: torch.nn.Module) -> None:
    """Make `linear`'s calls fire its adapters' forward pre-hooks (once per linear)."""
    if not getattr(linear, HOOKED, False):
        linear.register_forward_pre_hook(_pre_hook)
        setattr(linear, HOOKED, True)
