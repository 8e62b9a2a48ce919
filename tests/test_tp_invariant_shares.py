"""`layout_invariant.tensor_parallel.shares`: the fixed partition of a TP-sharded dimension and the canonical
segment tree.

Bitwise invariance across TP rests on three properties checked here for TP 1, 2, 4, 8 and
SwiGLU's stride 2, without processes:

- every TP degree runs the same chunk GEMMs: the chunks of all ranks' local shards, mapped to the
  world-size-1 columns through Megatron's own shard layout, are exactly the world-size-1 chunks;
- a rank's segments are a contiguous run of the world-size-1 segments (a subtree of the tree);
- the streamed `TreeSum` adds exactly the pairs of the recursive halves tree (an independent
  reference here), and finishing it over per-rank subtree partials in rank order gives the same
  bits at every split; it is a sum (float64, against `math.fsum`), and a rank-order chained
  combine of the TP = 4 partials (the negative control) differs from it on some input.

The autograd functions built on them are checked in tests/test_tp_invariant_segmented.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lora_patch.layout_invariant.tensor_parallel import TPInvariantUnsupported
from megatron_lora_patch.layout_invariant.tensor_parallel.shares import (
    CHUNK_COLUMNS,
    SEGMENTS,
    TreeSum,
    local_chunks,
    local_segments,
)
from megatron_lora_patch.lora.adapters.layouts import shard

WIDTHS = [(64, 1), (128, 2), (1024, 1), (4096, 2), (5120, 1), (50304, 1), (24, 1), (10240, 1)]
WORLDS = [1, 2, 4, 8]


def _global_segments(width: int, stride: int, world: int, rank: int) -> list:
    """Rank `rank`'s segments as lists of world-size-1 `(start, stop)` chunks, via Megatron's shard layout."""
    columns = shard(torch.arange(width), 0, rank, world, stride).tolist()
    found = []
    for segment in local_segments(width, stride, world):
        chunks = [(columns[start], columns[stop - 1] + 1) for start, stop in segment]
        assert all(stop - start == b - a for (start, stop), (a, b) in zip(chunks, segment)), "a chunk is split"
        found.append(chunks)
    return found


@pytest.mark.parametrize("width,stride", WIDTHS)
@pytest.mark.parametrize("world", WORLDS)
def test_every_tp_degree_runs_the_same_chunks_and_segments(width, stride, world):
    every_rank = [seg for rank in range(world) for seg in _global_segments(width, stride, world, rank)]
    assert every_rank == _global_segments(width, stride, 1, 0)  # rank r's segments: world-1 segments r*m ...
    assert all(0 < stop - start <= CHUNK_COLUMNS for segment in every_rank for start, stop in segment)


@pytest.mark.parametrize("width,stride", WIDTHS)
@pytest.mark.parametrize("world", WORLDS)
def test_local_chunks_partition_the_shard_in_order(width, stride, world):
    columns = [column for start, stop in local_chunks(width, stride, world) for column in range(start, stop)]
    assert columns == list(range(width // world))


def test_a_stride_part_is_cut_into_segments_within_each_part():
    segments = _global_segments(128, 2, 1, 0)
    assert len(segments) == SEGMENTS and segments[0] == [(0, 8), (64, 72)]  # gate then up, chained


@pytest.mark.parametrize("width,stride,world", [(24, 1, 16), (12, 1, 8), (1024, 1, 3), (96, 2, 16)])
def test_a_tp_degree_that_splits_a_segment_is_refused(width, stride, world):
    with pytest.raises(TPInvariantUnsupported, match=f"for TP {world}"):
        local_segments(width, stride, world)


# -- the tree --------------------------------------------------------------------------------


def _halves(items):
    """Independent reference: the recursive halves tree."""
    if len(items) == 1:
        return items[0].clone()
    return _halves(items[: len(items) // 2]) + _halves(items[len(items) // 2:])


def _streamed(items):
    tree = TreeSum()
    for item in items:
        tree.add(item.clone())
    return tree.result()


def _split_combine(items, world, combine):
    """Each of `world` ranks tree-sums its contiguous run of `items`; `combine` joins the rank partials."""
    per_rank = len(items) // world
    return combine([_streamed(items[r * per_rank:(r + 1) * per_rank]) for r in range(world)])


def _chained(items):
    total = items[0].clone()
    for item in items[1:]:
        total += item
    return total


def _segment_partials(seed: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 3, SEGMENTS, dtype=torch.float64)  # mixed magnitudes: order matters
    return [(torch.randn(4, 33, generator=generator, dtype=torch.float64) * s).to(dtype) for s in scales]


@pytest.mark.parametrize("count", [1, 2, 4, 8])
def test_streamed_tree_is_the_halves_tree(count):
    items = _segment_partials(7)[:count]
    assert torch.equal(_streamed(items), _halves(items))


@pytest.mark.parametrize("world", WORLDS)
def test_every_split_finishes_the_same_tree(world):
    for seed in range(5):
        items = _segment_partials(seed)
        assert torch.equal(_split_combine(items, world, _streamed), _halves(items))


def test_tree_is_a_sum_in_float64():
    items = _segment_partials(3, torch.float64)
    exact = torch.tensor([math.fsum(values) for values in torch.stack(items).reshape(SEGMENTS, -1).t().tolist()],
                         dtype=torch.float64).view_as(items[0])
    scale = max(item.abs().max().item() for item in items)
    assert (_streamed(items) - exact).abs().max().item() <= 1e-15 * scale
    assert (_chained(items) - exact).abs().max().item() <= 1e-15 * scale


def test_rank_order_chained_combine_differs_at_tp4():
    """Negative control: combining the TP = 4 partials left to right is not the tree, bitwise."""
    differs = [not torch.equal(_split_combine(_segment_partials(seed), 4, _chained), _halves(_segment_partials(seed)))
               for seed in range(5)]
    assert any(differs)


def test_a_count_that_is_not_a_power_of_two_is_refused():
    with pytest.raises(ValueError, match="power of two"):
        _streamed(_segment_partials(1)[:3])
