"""One DDP grad buffer's lanes: per-microbatch grads summed by lane, and their canonical combine
over the DP group (docs/architecture.md section 7; the hooks that fill them: `layout_invariant.lanes`).
"""

from __future__ import annotations

from typing import Any, Dict

import torch
import torch.distributed

from megatron_lora_patch.layout_invariant import LayoutInvariantUnsupported
from megatron_lora_patch.layout_invariant.tree import LANES, canonical_sum, lane_of, rank_lanes


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
