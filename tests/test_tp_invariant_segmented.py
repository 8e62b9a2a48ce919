"""`layout_invariant.tensor_parallel.segmented`: the column / row linears on local shards, bitwise equal across TP.

On gloo worlds of 1, 2 and 4 ranks, each rank gets Megatron's shards of the same float32 tensors
(column: W, b, B on out, stride 1 and SwiGLU's 2; row: W, A and the input on in) and runs forward +
backward with LoRA. Reassembled in the world-size-1 layout (column output shards, the SUM of the
row output shares, the sharded grads; the complete grads from every rank), every output and grad
is BITWISE equal to the world-size-1 run, and the world-size-1 run matches plain float64 autograd
(`x W^T + b + s (x A^T) B^T`) to float32 accuracy; negative control: the same comparison against a
reference whose LoRA scale is 1.1x fails by far more than 100x. The in / out widths give segments
of several chunks (a chained sum inside a segment) and whole-chunk segments.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lora_patch.lora.adapters.layouts import shard, unshard
from megatron_lora_patch.proof.testbed.launcher import run_world

SCALE = 0.7
TOKENS, RANK = 6, 3
#: (layer, stride, in, out): 10240 cuts the sharded dimension into 8 segments of 1280 columns (chunks
#: of 1024 + 256); SwiGLU's stride 2 chains the gate and up chunks of each segment.
CASES = [("column", 1, 40, 10240), ("column", 2, 96, 1024), ("row", 1, 10240, 48)]
NAMES = ("x", "weight", "bias", "lora_a", "lora_b")


def _tensors(case) -> dict:
    layer, stride, features, width = case
    generator = torch.Generator().manual_seed(features + width + stride)  # the same tensors on every rank

    def draw(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    tensors = {"x": draw(TOKENS, features), "weight": draw(width, features) / features ** 0.5,
               "lora_a": draw(RANK, features), "lora_b": draw(width, RANK), "grad": draw(TOKENS, width)}
    if layer == "column":
        tensors["bias"] = draw(width)
    return tensors


def _split_dims(case) -> dict:
    """The dim (and stride) each tensor is sharded on; None: replicated / complete."""
    layer, stride = case[0], case[1]
    if layer == "column":
        return {"weight": (0, stride), "bias": (0, stride), "lora_b": (0, stride), "out": (-1, stride),
                "x": None, "lora_a": None}
    return {"x": (-1, 1), "weight": (1, 1), "lora_a": (1, 1), "lora_b": None, "out": None, "bias": None}


def _local(tensor, split, rank, world):
    return tensor if split is None else shard(tensor, split[0], rank, world, split[1])


def _rank_case(case, rank: int, world: int, group) -> dict:
    from megatron_lora_patch.layout_invariant.tensor_parallel import segmented

    tensors, dims = _tensors(case), _split_dims(case)
    leaves = {name: _local(tensors[name], dims[name], rank, world).float().requires_grad_()
              for name in NAMES if name in tensors}
    lora = (leaves["lora_a"], leaves["lora_b"], SCALE)
    if case[0] == "column":
        out = segmented.column_linear(leaves["x"], leaves["weight"], leaves["bias"], lora, case[1], group)
    else:
        out = segmented.row_linear(leaves["x"], leaves["weight"], lora, group)
    out.backward(_local(tensors["grad"], dims["out"], rank, world).float())  # row: the SUM's backward is complete
    return {"out": out.detach(), **{name: leaf.grad for name, leaf in leaves.items()}}


def _world(rank: int, world_size: int) -> list:
    import torch.distributed

    from megatron_lora_patch.proof.testbed.rank import gloo_process_group

    with gloo_process_group():
        return [_rank_case(case, rank, world_size, torch.distributed.group.WORLD) for case in CASES]


def _assembled(case, ranks: list) -> dict:
    """Every output / grad in the world-size-1 layout; complete ones must agree on every rank."""
    dims, assembled = _split_dims(case), {}
    for name in ranks[0]:
        pieces = [result[name] for result in ranks]
        if name == "out" and case[0] == "row":
            assembled[name] = sum(pieces[1:], pieces[0])  # Megatron's SUM of the shares
        elif dims[name] is None:
            assert all(torch.equal(piece, pieces[0]) for piece in pieces), f"{name} differs across ranks"
            assembled[name] = pieces[0]
        else:
            assembled[name] = unshard(pieces, dims[name][0], dims[name][1])
    return assembled


def _reference(case, scale: float) -> dict:
    tensors = _tensors(case)
    leaves = {name: tensors[name].clone().requires_grad_() for name in NAMES if name in tensors}
    out = leaves["x"] @ leaves["weight"].t() + scale * (leaves["x"] @ leaves["lora_a"].t()) @ leaves["lora_b"].t()
    out = out + leaves["bias"] if "bias" in leaves else out
    out.backward(tensors["grad"])
    return {"out": out.detach(), **{name: leaf.grad for name, leaf in leaves.items()}}


def _worst_error(got: dict, want: dict) -> float:
    return max(((got[name].double() - want[name]).abs().max() / want[name].abs().max()).item() for name in want)


@pytest.fixture(scope="module")
def world_one() -> list:
    return run_world(_world, 1, name="tp1")[0]


#: float32 with a few thousand terms per dot product, against float64.
TOLERANCE = 1e-5


def test_world_one_is_the_float64_math(world_one):
    for index, case in enumerate(CASES):
        assert _worst_error(world_one[index], _reference(case, SCALE)) < TOLERANCE, case
        assert _worst_error(world_one[index], _reference(case, 1.1 * SCALE)) > 100 * TOLERANCE, case


@pytest.mark.parametrize("world", [2, 4])
def test_every_output_and_grad_is_bitwise_the_world_one_value(world_one, world):
    ranks = run_world(_world, world, name=f"tp{world}")
    for index, case in enumerate(CASES):
        assembled = _assembled(case, [result[index] for result in ranks])
        assert assembled.keys() == world_one[index].keys()
        for name, value in assembled.items():
            assert torch.equal(value, world_one[index][name]), f"{case} {name}"
