"""The canonical reduction tree over global microbatches (docs/architecture.md section 7).

A step's gradient is the sum of one gradient per global microbatch. Floating-point addition
is not associative, so that sum is bitwise reproducible only if it is always formed in the
same order, whatever the data-parallel degree. Megatron's `MegatronPretrainingSampler` deals
global microbatch `g` to DP rank `g % dp` as its local microbatch `g // dp` (interleaved), so
the order is fixed here as a function of `g` alone, in two levels:

- `LANES` lanes: microbatch `g` goes to lane `g % LANES`; a lane is the chained sum of its
  microbatches in increasing `g` (streamed: one adapter-sized buffer per lane);
- the lane sums are combined by `canonical_sum`, a binary tree that splits its operands by
  the lowest bit of their index first (even lanes, odd lanes, recursively).

For any `dp` dividing `LANES`, DP rank `r` holds exactly the lanes `r, r + dp, r + 2 dp, ...`,
and those lanes form ONE subtree of `canonical_sum` (the subtree property). So each rank sums
its own lanes into one partial, the partials are all-gathered, and `canonical_sum` over the
partials in DP rank order finishes the very same tree: every rank gets the dp = 1 bits.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

#: Lanes of the microbatch tree: data-parallel degrees dividing it (1, 2, 4, 8) give the same bits.
LANES = 8


def canonical_sum(items: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """The tree sum of `items`: `canonical_sum(items[0::2]) + canonical_sum(items[1::2])`, down to
    single items; a None item (an empty lane) is skipped. Returns a new tensor, or the single
    non-None item itself, or None when every item is None."""
    if len(items) <= 1:
        return items[0] if items else None
    even, odd = canonical_sum(items[0::2]), canonical_sum(items[1::2])
    if even is None or odd is None:
        return odd if even is None else even
    return even + odd


def lane_of(local_microbatch: int, dp_rank: int, dp_size: int) -> int:
    """The lane of DP rank `dp_rank`'s `local_microbatch`-th microbatch (global index `i * dp + r`)."""
    return (local_microbatch * dp_size + dp_rank) % LANES


def rank_lanes(dp_rank: int, dp_size: int) -> List[int]:
    """The lanes DP rank `dp_rank` of `dp_size` holds, in the order its subtree takes them."""
    check_dp_size(dp_size)
    return list(range(dp_rank, LANES, dp_size))


def check_dp_size(dp_size: int) -> None:
    """The subtree property needs a DP degree dividing `LANES`; one line naming the fix otherwise."""
    from megatron_lora_patch.layout_invariant import LayoutInvariantUnsupported

    if LANES % dp_size:
        raise LayoutInvariantUnsupported(
            f"layout_invariant: data-parallel size {dp_size} does not divide the {LANES} microbatch lanes; "
            f"use a data-parallel size of 1, 2, 4 or 8"
        )
