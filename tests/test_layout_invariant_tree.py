"""The canonical microbatch tree of the layout-invariant mode (docs/architecture.md section 7),
on plain tensors: no Megatron, no world.

- every split of `canonical_sum` has the operand shape (shapes at every split);
- it is a sum: float64 tree vs float64 chained sum within 1e-12 relative, while a scale error
  of 1e-6 misses by far more (the reference can fail);
- the subtree property: for dp = 1, 2, 4, 8 the rank partials (`rank_lanes`), all-gathered and
  combined in rank order, give the dp = 1 bits in float32, whereas combining in rank order with a
  chained sum (the mutation the mode must not be) does not;
- lanes follow Megatron's interleaved sampler: global microbatch `i * dp + r`.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lora_patch.layout_invariant import LayoutInvariantUnsupported
from megatron_lora_patch.layout_invariant.tree import LANES, canonical_sum, check_dp_size, lane_of, rank_lanes


def _lanes(dtype=torch.float32, shape=(3, 5), seed=0) -> list:
    generator = torch.Generator().manual_seed(seed)
    # Magnitudes spread over 6 decades so that the summation order shows in the last bits.
    return [torch.randn(shape, generator=generator, dtype=dtype) * 10.0 ** (index % 6) for index in range(LANES)]


def _chained(items: list) -> torch.Tensor:
    total = items[0].clone()
    for item in items[1:]:
        total = total + item
    return total


def test_every_split_keeps_the_operand_shape():
    seen = []

    lanes = _lanes(shape=(2, 7))
    total = canonical_sum(lanes)
    for width in (1, 2, 4, 8):
        for offset in range(width):
            part = canonical_sum(lanes[offset::width])
            seen.append(tuple(part.shape))
    assert tuple(total.shape) == (2, 7) and set(seen) == {(2, 7)}


def test_tree_is_a_sum_in_float64():
    lanes = _lanes(torch.float64)
    tree, chained = canonical_sum(lanes), _chained(lanes)
    error = float((tree - chained).norm() / chained.norm())
    scaled = float((tree * (1 + 1e-6) - chained).norm() / chained.norm())
    assert error < 1e-12 and scaled > 100 * 1e-12


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_rank_partials_finish_the_same_tree(dp):
    lanes = _lanes()
    whole = canonical_sum(lanes)
    partials = [canonical_sum([lanes[lane] for lane in rank_lanes(rank, dp)]) for rank in range(dp)]
    assert torch.equal(canonical_sum(partials), whole)
    assert sorted(lane for rank in range(dp) for lane in rank_lanes(rank, dp)) == list(range(LANES))


def test_rank_order_chained_sum_differs():
    """The negative control: the same lanes, summed per rank and then in rank order, change the bits."""
    lanes = _lanes()
    whole = canonical_sum(lanes)
    for dp in (2, 4):
        partials = [_chained([lanes[lane] for lane in rank_lanes(rank, dp)]) for rank in range(dp)]
        assert not torch.equal(_chained(partials), whole)


def test_empty_lanes_are_skipped():
    lanes = _lanes()
    sparse = [lane if index < 3 else None for index, lane in enumerate(lanes)]
    assert torch.equal(canonical_sum(sparse), (lanes[0] + lanes[2]) + lanes[1])
    assert canonical_sum([None] * LANES) is None


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_lanes_follow_megatrons_interleaved_sampler(dp):
    for rank in range(dp):
        for local in range(3 * LANES):
            lane = lane_of(local, rank, dp)
            assert lane == (local * dp + rank) % LANES and lane in rank_lanes(rank, dp)


@pytest.mark.parametrize("dp", [3, 6, 16])
def test_a_dp_size_off_the_lanes_is_refused(dp):
    with pytest.raises(LayoutInvariantUnsupported, match="use a data-parallel size of 1, 2, 4 or 8"):
        check_dp_size(dp)
