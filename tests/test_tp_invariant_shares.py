"""`tp_invariant.shares`: the partition of a TP-invariant linear's output columns.

Bitwise invariance across TP rests on two properties of `owned_chunks`, checked here for TP 1,
2, 4, 8 and SwiGLU's stride 2: every TP degree runs the same chunk GEMMs (the same column ranges,
hence the same shapes), and the chunks a rank owns are exactly Megatron's shard of the output,
in the shard's order. The autograd function is checked on gloo worlds of 1 and 2 in float64
against plain autograd: outputs (column shards, row shares summed) and the complete input,
weight, bias and LoRA grads on every rank (the weight and bias grads are what full training
in the mode uses; LoRA training never asks for them). Bitwise equality across TP degrees is
checked end to end by tests/test_tp_invariant.py (TP 1 / 2 / 4 training).
"""

from __future__ import annotations

import pytest
import torch

from megatron_lora_patch.lora.adapters.layouts import shard
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


# -- the autograd function on a real gloo world (float64) ------------------------------------

CASES = [("column", 1), ("column", 2), ("row", 1)]  # (layer, stride): column keeps its shard, row places its share
SCALE = 0.7


def _case_tensors(stride: int) -> dict:
    generator = torch.Generator().manual_seed(1234 + stride)  # the same tensors on every rank

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    tokens, features, width, rank = 6, 16, 64, 3
    return {
        "x": draw(tokens, features),
        "weight": draw(width, features),
        "bias": draw(width),
        "hidden": draw(tokens, rank),
        "lora_b": draw(width, rank),
        "grad": draw(tokens, width),
    }


def _leaves(tensors: dict) -> dict:
    return {name: tensors[name].clone().requires_grad_() for name in ("x", "weight", "bias", "hidden", "lora_b")}


def _reference(tensors: dict, scale: float = SCALE) -> tuple:
    """`x W^T + b + s h B^T` and its grads by plain autograd, the world-size-1 math."""
    leaves = _leaves(tensors)
    out = leaves["x"] @ leaves["weight"].t() + leaves["bias"] + scale * leaves["hidden"] @ leaves["lora_b"].t()
    out.backward(tensors["grad"])
    return out.detach(), {name: leaf.grad for name, leaf in leaves.items()}


def _owned_share_world(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state

    from megatron_lora_patch.proof.testbed.topology import Topology

    with Topology.parse(f"tp{world_size}").world(seed=1234):
        return _owned_share_cases(rank, world_size, parallel_state.get_tensor_model_parallel_group())


def _owned_share_cases(rank: int, world_size: int, group) -> dict:
    from megatron_lora_patch.tp_invariant.shares import owned_columns_linear

    results = {}
    for layer, stride in CASES:
        tensors = _case_tensors(stride)
        leaves = _leaves(tensors)
        keep = layer == "column"
        out = owned_columns_linear(
            leaves["x"],
            leaves["weight"],
            leaves["bias"],
            (leaves["hidden"], leaves["lora_b"], SCALE),
            stride,
            group,
            keep,
        )
        # column: this rank holds its columns' grad; row: Megatron's SUM passes the complete grad back
        upstream = shard(tensors["grad"], -1, rank, world_size, stride) if keep else tensors["grad"]
        out.backward(upstream)
        results[(layer, stride)] = (out.detach(), {name: leaf.grad for name, leaf in leaves.items()})
    return results


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _errors(ranks: list, scale: float = SCALE) -> dict:
    """Worst relative error per case of every rank's output (its shard, or the SUM of the shares) and grads."""
    errors = {}
    for layer, stride in CASES:
        want_out, want_grads = _reference(_case_tensors(stride), scale)
        outs = [ranks[rank][(layer, stride)][0] for rank in range(len(ranks))]
        if layer == "column":
            out_error = max(
                _relative_error(out, shard(want_out, -1, rank, len(ranks), stride)) for rank, out in enumerate(outs)
            )
        else:
            out_error = _relative_error(sum(outs), want_out)
        grad_error = max(
            _relative_error(result[(layer, stride)][1][name], want)
            for result in ranks
            for name, want in want_grads.items()
        )
        errors[(layer, stride)] = max(out_error, grad_error)
    return errors


#: float64, a few dozen terms per dot product: the reordering noise is ~1e-16 relative.
TOLERANCE = 1e-12


@pytest.mark.parametrize("world", [1, 2])
def test_share_output_and_complete_grads_match_the_world_size_1_math(world):
    from megatron_lora_patch.proof.testbed.launcher import run_world

    ranks = run_world(_owned_share_world, world, name=f"tp{world}")
    assert max(_errors(ranks).values()) < TOLERANCE
    # negative control: the same comparison against a reference whose LoRA term is scaled 1.1x fails >= 100x
    assert min(_errors(ranks, scale=1.1 * SCALE).values()) > 100 * TOLERANCE
    # a row rank writes zeros outside its share: the SUM counts each column once
    for rank, result in enumerate(ranks):
        outside = torch.ones(result[("row", 1)][0].shape[1], dtype=torch.bool)
        for start, stop in owned_chunks(outside.numel(), 1, world, rank):
            outside[start:stop] = False
        assert (result[("row", 1)][0][:, outside] == 0).all() and outside.sum() == outside.numel() * (
            world - 1
        ) // world
