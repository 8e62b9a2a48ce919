"""`tp_invariant.shares`: the partition of a TP-invariant linear's output columns.

Bitwise invariance across TP rests on two properties of `owned_chunks`, checked here for TP 1,
2, 4, 8 and SwiGLU's stride 2: every TP degree runs the same chunk GEMMs (the same column ranges,
hence the same shapes), and the chunks a rank owns are exactly Megatron's shard of the output,
in the shard's order. The numerics across TP degrees are checked end to end by
tests/test_tp_invariant.py (bitwise TP 1 / 2 / 4 training).
"""

from __future__ import annotations

import pytest
import torch

from megatron_lora_patch.lora.layouts import shard
from megatron_lora_patch.tp_invariant import TPInvariantUnsupported
from megatron_lora_patch.tp_invariant.shares import CHUNK_COLUMNS, owned_chunks

WIDTHS = [(64, 1), (128, 2), (1024, 1), (4096, 2), (5120, 1), (50304, 1), (24, 1)]


def _columns(chunks) -> list:
    return [column for start, stop in chunks for column in range(start, stop)]


@pytest.mark.parametrize("width,stride", WIDTHS)
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_tp_degree_runs_the_same_chunks(width, stride, world):
    every_rank = [chunk for rank in range(world) for chunk in owned_chunks(width, stride, world, rank)]
    assert sorted(every_rank) == sorted(owned_chunks(width, stride, 1, 0))
    assert all(0 < stop - start <= CHUNK_COLUMNS for start, stop in every_rank)


@pytest.mark.parametrize("width,stride", WIDTHS)
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_owned_chunks_are_megatrons_shard_in_order(width, stride, world):
    logical = torch.arange(width)
    for rank in range(world):
        expected = shard(logical, 0, rank, world, stride).tolist()
        assert _columns(owned_chunks(width, stride, world, rank)) == expected


def test_world_one_is_the_whole_output_in_order():
    assert _columns(owned_chunks(4096, 2, 1, 0)) == list(range(4096))


@pytest.mark.parametrize("width,stride,world", [(24, 1, 16), (12, 1, 8), (1024, 1, 3), (96, 2, 16)])
def test_a_tp_degree_that_splits_a_segment_is_refused(width, stride, world):
    with pytest.raises(TPInvariantUnsupported, match=f"for TP {world}"):
        owned_chunks(width, stride, world, 0)
