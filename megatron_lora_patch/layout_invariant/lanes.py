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

import torch
import torch.distributed

from megatron_lora_patch.layout_invariant import LayoutInvariantUnsupported
from megatron_lora_patch.layout_invariant.tree import LANES, canonical_sum, lane_of, rank_lanes

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


class BufferLanes:
    """This rank's lane sums of one DDP grad buffer, each flat and laid out like `buffer.grad_data`."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.group = buffer.data_parallel_group
        self.dp_rank = torch.distributed.get_rank(self.group)
        self.dp_size = torch.distributed.get_world_size(self.group)
        self.lanes = rank_lanes(self.dp_rank, self.dp_size)
        self.flat: Dict[int, torch.Tensor] = {}
        self.used: set = set()
        self.ranges = {param: buffer.param_index_map[param][:2] for param in buffer.params}
        for param, (start, _) in self.ranges.items():
            if param.main_grad.data_ptr() != buffer.grad_data[start:].data_ptr():
                raise LayoutInvariantUnsupported(
                    "layout_invariant: a parameter's main_grad is not a view of its DDP grad buffer (this "
                    "Megatron-Core lays grads out differently); turn the layout_invariant patch off"
                )

    def add(self, param: Any, grad: torch.Tensor, microbatch: int) -> None:
        """Add one local microbatch's `grad` of `param` into that microbatch's lane."""
        self.add_to_lane(param, grad, lane_of(microbatch, self.dp_rank, self.dp_size))

    def add_global(self, param: Any, grad: torch.Tensor, global_microbatch: int) -> None:
        """Add the `grad` of `param` from global microbatch `global_microbatch` (the expert path,
        `layout_invariant.experts`), which must be one of this DP rank's own microbatches."""
        if global_microbatch % self.dp_size != self.dp_rank:
            raise LayoutInvariantUnsupported(
                f"layout_invariant: DP rank {self.dp_rank} of {self.dp_size} got a grad of global microbatch "
                f"{global_microbatch}, which another rank holds; deal data like MegatronPretrainingSampler"
            )
        self.add_to_lane(param, grad, global_microbatch % LANES)

    def add_to_lane(self, param: Any, grad: torch.Tensor, lane: int) -> None:
        """Add `grad` of `param` into `lane` (chained: the lane's first grad of a step overwrites)."""
        flat = self.flat.get(lane)
        if flat is None:
            flat = self.flat[lane] = torch.zeros_like(self.buffer.grad_data)
        elif lane not in self.used:
            flat.zero_()
        self.used.add(lane)
        start, end = self.ranges[param]
        flat[start:end].view(param.shape).add_(grad)

    def reset(self) -> None:
        self.used.clear()

    def reduce_into_grad_buffer(self) -> None:
        """grad_data = the canonical tree over every global microbatch, identical on every DP rank."""
        partial = canonical_sum([self.flat[lane] if lane in self.used else None for lane in self.lanes])
        if partial is None:
            partial = torch.zeros_like(self.buffer.grad_data)
        if self.dp_size > 1:
            pieces = [torch.empty_like(partial) for _ in range(self.dp_size)]
            torch.distributed.all_gather(pieces, partial.contiguous(), group=self.group)
            partial = canonical_sum(pieces)
        self.buffer.grad_data.copy_(partial)


def _lanes(ddp: Any) -> Dict[Any, BufferLanes]:
    """{param: its BufferLanes} of a DDP module, built on first use (the first `zero_grad_buffer` of a
    step, at the latest its first grad) after the mode's checks (`layout_invariant.checks`)."""
    from megatron_lora_patch.layout_invariant import checks
    from megatron_lora_patch.layout_invariant.expert_lanes import ExpertBufferLanes

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
