"""`segmented.row_sums` and `collectives.share_grad`, the two pieces expert TP adds to the
layout-invariant mode (docs/architecture.md section 7, "Expert TP").

On gloo worlds of 1, 2 and 4 ranks, each rank holds Megatron's shard (on the last dimension) of the
same float32 `[6, 10240]` tensor (8 segments of 1280 columns: chunks of 1024 + 256, so a segment
chains two chunk sums):
- `row_sums` is complete and BITWISE the world-size-1 value on every rank; that value is the float64
  row sum to float32 accuracy; negative control: the per-rank partial sums added in rank order
  (what a SUM over the group forms) differ from it at world 4;
- `share_grad`'s backward hands each rank the columns it owns, zeros elsewhere, and the SUM of the
  ranks' grads is the complete grad exactly.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lora_patch.lora.adapters.layouts import shard
from megatron_lora_patch.proof.testbed.launcher import run_world

TOKENS, WIDTH = 6, 10240


def _tensor() -> torch.Tensor:
    return torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _world(rank: int, world_size: int) -> dict:
    import torch.distributed

    from megatron_lora_patch.layout_invariant.tensor_parallel.collectives import share_grad
    from megatron_lora_patch.layout_invariant.tensor_parallel.segmented import row_sums
    from megatron_lora_patch.proof.testbed.rank import gloo_process_group

    with gloo_process_group():
        group = torch.distributed.group.WORLD
        local = shard(_tensor(), -1, rank, world_size, 1).float()
        partials = [torch.empty(TOKENS) for _ in range(world_size)]
        torch.distributed.all_gather(partials, local.sum(dim=1), group=group)
        leaf = _tensor().float().requires_grad_()
        share_grad(leaf, group).backward(_tensor().float() * 3)
        return {"sums": row_sums(local, group), "rank_order": sum(partials[1:], partials[0]), "grad": leaf.grad}


@pytest.fixture(scope="module")
def world_one() -> dict:
    return run_world(_world, 1, name="tp1")[0]


def test_world_one_is_the_float64_sum(world_one):
    reference = _tensor().sum(dim=1)
    error = ((world_one["sums"].double() - reference).abs().max() / reference.abs().max()).item()
    assert error < 1e-5
    assert ((1.01 * world_one["sums"].double() - reference).abs().max() / reference.abs().max()).item() > 1e-3


@pytest.mark.parametrize("world", [2, 4])
def test_row_sums_are_bitwise_the_world_one_value(world_one, world):
    ranks = run_world(_world, world, name=f"tp{world}")
    for result in ranks:
        assert torch.equal(result["sums"], world_one["sums"])
    if world == 4:
        assert (ranks[0]["rank_order"] - world_one["sums"]).abs().max() > 0


def test_share_grad_sums_to_the_complete_grad_exactly():
    ranks = run_world(_world, 2, name="tp2")
    complete = _tensor().float() * 3
    for rank, result in enumerate(ranks):
        owned = slice(WIDTH * rank // 2, WIDTH * (rank + 1) // 2)
        assert torch.equal(result["grad"][:, owned], complete[:, owned])
        assert int(torch.count_nonzero(result["grad"])) == TOKENS * WIDTH // 2
    assert torch.equal(ranks[0]["grad"] + ranks[1]["grad"], complete)
