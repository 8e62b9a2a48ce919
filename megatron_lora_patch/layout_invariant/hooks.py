"""What the `layout_invariant` patch installs beyond the TP-invariant hooks (`tp_invariant.hooks`):
Megatron DDP's grad accumulation and DP reduction in the canonical tree, and the microbatch
numbering in the schedules (docs/architecture.md section 7).
"""

from __future__ import annotations

_STATE = {"active": False}


def is_active() -> bool:
    """Whether the layout-invariant patch is applied in this process (the testbed's loss report asks)."""
    return _STATE["active"]


def patch_ddp(patcher, ddp) -> None:
    """Per-microbatch grads into lanes, the lane tree instead of DDP's all-reduce. (`__init__` is the
    loss_normalization patch's: each DDP module gets its lanes, after the mode's checks, on first use.)"""
    from megatron_lora_patch.layout_invariant import lanes

    owner = ddp.DistributedDataParallel
    patcher.wrap(owner, "_make_backward_post_hook", lanes.make_backward_post_hook)
    patcher.wrap(owner, "zero_grad_buffer", lanes.zero_grad_buffer)
    patcher.wrap(owner, "finish_grad_sync", lanes.finish_grad_sync)
    _STATE["active"] = True
    patcher.on_revert(lambda: _STATE.update(active=False))


def patch_schedules(patcher, schedules) -> None:
    """Number the microbatches whose backward runs (every schedule calls the module's `backward_step`)."""
    from megatron_lora_patch.layout_invariant import lanes

    patcher.wrap(schedules, "backward_step", lanes.counted_backward_step)
