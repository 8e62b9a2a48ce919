"""The lanes of an expert-parallel DDP grad buffer and their combine (docs/architecture.md section 7).

Under expert parallelism (ep > 1) Megatron DDP keeps the expert parameters in separate buffers
reduced over the expert-data-parallel group. An expert rank computes the grads of microbatches of
several DP ranks (its EP group's), added by global microbatch `g` into lane `g % LANES`
(`layout_invariant.experts`). Every lane lives whole on one expert-DP rank (its microbatches
`g, g + 8, ...` are all dealt to DP rank `g % dp`, which belongs to one EP group), but the lanes of
one expert-DP rank are in general NOT a subtree of `tree.canonical_sum` (dp4 ep2: lanes {0, 1, 4, 5}
on one rank, {2, 3, 6, 7} on the other). So the combine all-gathers every lane over the expert-DP
group (adapter-sized: `LANES` buffers per rank) and runs the whole canonical tree over the 8 lanes
on every rank: the same tree, over the same lane values, as at world size 1, where the expert
params sit in a dense buffer (ep = 1) and its subtree combine ends in that tree too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed

from megatron_lora_patch.layout_invariant import LayoutInvariantUnsupported
from megatron_lora_patch.layout_invariant.buffer_lanes import BufferLanes
from megatron_lora_patch.layout_invariant.tree import LANES, canonical_sum


class ExpertBufferLanes(BufferLanes):
    """The lanes of one expert-parallel grad buffer: filled by global microbatch only (`add_global`)."""

    def add(self, param: Any, grad: torch.Tensor, microbatch: int) -> None:
        raise LayoutInvariantUnsupported(
            "layout_invariant: an expert parameter got a grad outside the chunked expert path (experts other "
            "than SequentialMLP?); use moe_grouped_gemm=False with the local SequentialMLP experts"
        )

    def add_global(self, param: Any, grad: torch.Tensor, global_microbatch: int) -> None:
        """Add the `grad` of `param` from global microbatch `global_microbatch` into its lane."""
        self.add_to_lane(param, grad, global_microbatch % LANES)

    def reduce_into_grad_buffer(self) -> None:
        """grad_data = the canonical tree over all lanes, each taken from the one rank that holds it."""
        empty = torch.zeros_like(self.buffer.grad_data)
        stacked = torch.stack([self.flat[lane] if lane in self.used else empty for lane in range(LANES)])
        used = torch.tensor([lane in self.used for lane in range(LANES)])
        pieces, flags = [stacked], [used]
        if self.dp_size > 1:
            pieces = [torch.empty_like(stacked) for _ in range(self.dp_size)]
            flags = [torch.empty_like(used) for _ in range(self.dp_size)]
            torch.distributed.all_gather(pieces, stacked, group=self.group)
            torch.distributed.all_gather(flags, used, group=self.group)
        self.buffer.grad_data.copy_(combine_lanes(pieces, flags, empty))


def combine_lanes(pieces: list, flags: list, empty: torch.Tensor) -> torch.Tensor:
    """The canonical tree over `LANES` lanes; lane `l` is `pieces[r][l]` of the one rank `r` whose
    `flags[r][l]` is set (None, i.e. skipped, where no rank holds it)."""
    lanes = []
    for lane in range(LANES):
        holders = [rank for rank, flag in enumerate(flags) if bool(flag[lane])]
        if len(holders) > 1:
            raise LayoutInvariantUnsupported(
                f"layout_invariant: expert lane {lane} was filled on expert-DP ranks {holders}; data must be dealt "
                "like MegatronPretrainingSampler (global microbatch i * dp + r on DP rank r)"
            )
        lanes.append(pieces[holders[0]][lane] if holders else None)
    total = canonical_sum(lanes)
    return empty if total is None else total
