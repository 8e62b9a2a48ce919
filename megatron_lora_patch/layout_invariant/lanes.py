"""Per-microbatch gradients summed in the canonical tree instead of Megatron's running sum
(docs/architecture.md section 7).

Megatron DDP adds each microbatch's `param.grad` into `param.main_grad` as it arrives (a
chained sum over this rank's microbatches) and then all-reduces `main_grad` over data
parallel: both orders change with the DP degree. Here, for every parameter DDP owns:

- the backward post-hook adds the grad into the LANE of the current global microbatch
  (`tree.lane_of`: the schedule's `backward_step` calls are counted since `zero_grad_buffer`);
  a lane is a flat buffer laid out like the DDP grad buffer, allocated on first use;
- `finish_grad_sync` (called by `finalize_model_grads`) sums this rank's lanes with
  `tree.canonical_sum` into one partial, all-gathers the partials over the DP group and
  finishes the same tree over them in DP rank order, and writes the result into the grad
  buffer: every DP rank holds the dp = 1 sum, bit for bit, and no all-reduce runs.

Memory: up to `LANES / dp` lane buffers the size of the trainable grads (adapter-sized under
LoRA) per rank, plus `dp` gathered partials during the combine. Communication: one all-gather
of the grad buffer per step instead of one all-reduce (the same bytes received, dp times the
bytes kept until the combine).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, Optional

from megatron_lora_patch.layout_invariant import LayoutInvariantUnsupported
from megatron_lora_patch.layout_invariant.buffer_lanes import BufferLanes
from megatron_lora_patch.layout_invariant.expert_lanes import ExpertBufferLanes

#: DDP module -> {param: its BufferLanes}
_LANES_OF: "weakref.WeakKeyDictionary[Any, Dict[Any, BufferLanes]]" = weakref.WeakKeyDictionary()
#: Attribute naming a parameter's BufferLanes (the expert path adds grads by parameter alone).
LANES_ATTRIBUTE = "layout_invariant_lanes"


class _Microbatches:
    """Which local microbatch's backward is running: `backward_step` calls since `zero_grad_buffer`."""

    def __init__(self) -> None:
        self.started = 0
        self.current: Optional[int] = None

    def reset(self) -> None:
        self.started, self.current = 0, None


MICROBATCHES = _Microbatches()


def _lanes(ddp: Any) -> Dict[Any, BufferLanes]:
    """{param: its BufferLanes} of a DDP module, built on first use (the first `zero_grad_buffer` of a
    step, at the latest its first grad) after the mode's checks (`layout_invariant.checks`)."""
    from megatron_lora_patch.layout_invariant import checks

    per_param = _LANES_OF.get(ddp)
    if per_param is None:
        checks.check_parallelism(ddp.config, ddp.ddp_config)
        checks.check_training(ddp.config, ddp.module)
        per_param = {}
        buffers = [(buffer, BufferLanes) for buffer in ddp.buffers]
        buffers += [(buffer, ExpertBufferLanes) for buffer in getattr(ddp, "expert_parallel_buffers", ())]
        for buffer, kind in buffers:
            lanes = kind(buffer)
            per_param.update(dict.fromkeys(lanes.ranges, lanes))
        _LANES_OF[ddp] = per_param
        for param, lanes in per_param.items():
            setattr(param, LANES_ATTRIBUTE, lanes)
    return per_param


def lanes_of_param(param: Any) -> BufferLanes:
    """The lanes of a parameter some DDP module owns (built at its first `zero_grad_buffer`)."""
    lanes = getattr(param, LANES_ATTRIBUTE, None)
    if lanes is None:
        raise LayoutInvariantUnsupported(
            "layout_invariant: an expert parameter's grad arrived before its DDP module's first zero_grad_buffer "
            "(or the parameter is not wrapped in Megatron DDP); wrap the model in DDP and zero its grad buffer"
        )
    return lanes


def make_backward_post_hook(wrapped, instance, args, kwargs):
    """wrapt wrapper of `DistributedDataParallel._make_backward_post_hook(param)`: the hook adds the
    grad into the current microbatch's lane (Megatron's own hook for params without lanes)."""
    original = wrapped(*args, **kwargs)
    param = args[0] if args else kwargs["param"]

    def hook(*unused):
        lanes = _lanes(instance).get(param)
        if lanes is None or param.grad is None:
            return original(*unused)
        if getattr(param, "grad_added_to_main_grad", False):
            raise LayoutInvariantUnsupported(
                "layout_invariant: a fused kernel accumulated a grad straight into main_grad "
                "(gradient_accumulation_fusion); turn gradient_accumulation_fusion off"
            )
        if MICROBATCHES.current is None:
            raise LayoutInvariantUnsupported(
                "layout_invariant: a gradient arrived outside Megatron's schedule (backward_step), so its global "
                "microbatch is unknown; run backward through get_forward_backward_func()"
            )
        lanes.add(param, param.grad.data, MICROBATCHES.current)
        param.grad = None

    return hook


def counted_backward_step(wrapped, instance, args, kwargs):
    """wrapt wrapper of `schedules.backward_step`: number the microbatches whose grads arrive."""
    MICROBATCHES.current = MICROBATCHES.started
    MICROBATCHES.started += 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        MICROBATCHES.current = None


def zero_grad_buffer(wrapped, instance, args, kwargs):
    """wrapt wrapper of `DistributedDataParallel.zero_grad_buffer`: a new step starts at microbatch 0."""
    result = wrapped(*args, **kwargs)
    MICROBATCHES.reset()
    for lanes in set(_lanes(instance).values()):
        lanes.reset()
    return result


def finish_grad_sync(wrapped, instance, args, kwargs):
    """wrapt wrapper of `DistributedDataParallel.finish_grad_sync`: the canonical tree replaces the
    DP all-reduce / reduce-scatter of every buffer that has lanes."""
    per_param = _lanes(instance)
    if not per_param:
        return wrapped(*args, **kwargs)
    for lanes in dict.fromkeys(per_param.values()):
        lanes.reduce_into_grad_buffer()
    return None


def lane_bytes() -> int:
    """Bytes held by this process's lane buffers (the mode's adapter-sized extra grad memory)."""
    buffers = {id(lanes): lanes for per_param in _LANES_OF.values() for lanes in per_param.values()}
    return sum(flat.nbytes for lanes in buffers.values() for flat in lanes.flat.values())
