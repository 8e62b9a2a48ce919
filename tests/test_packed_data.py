"""Packed (THD) data on the CPU testbed: TE's per-sequence CP split, the packed batches and the packed
core attention (proof/testbed/packing.py, cpu_testbed/thd.py, proof/testbed/cp_attention.py).

The attention runs at cp1 and cp2 (tests/packed_worker.py) on a row of four sequences of unequal
lengths and is compared, output and q / k / v grads, with a dense reference that runs every sequence
on its own (causal softmax attention, GQA); a control shows that attention over the whole row (leaking
across sequences) would be caught.
"""

from __future__ import annotations

import pytest
import torch
from packed_worker import CU_SEQLENS, GROUPS, HEADS, packed_attention_rank, packed_inputs

from megatron_lora_patch.cpu_testbed.thd import install_thd_partition, thd_get_partitioned_indices
from megatron_lora_patch.proof.testbed.data import make_global_batch
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.packing import cu_seqlens_of, make_packed_global_batch
from megatron_lora_patch.runtime.patching import Patcher

#: fp32: the same scores per query row, summed in another order across CP ranks.
TOLERANCE = 1e-5
SEED = 7


def _owner(offset: int, length: int, cp: int) -> int:
    """TE's definition: chunk c of 2*cp belongs to rank c (first half) or 2*cp-1-c (second half)."""
    chunk = offset // (length // (2 * cp))
    return chunk if chunk < cp else 2 * cp - 1 - chunk


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_thd_partition_is_tes_per_sequence_split(cp):
    bounds = (0, 8, 16, 40, 48)
    seen = []
    for rank in range(cp):
        index = thd_get_partitioned_indices(torch.tensor(bounds, dtype=torch.int32), bounds[-1], cp, rank)
        expected = [
            position
            for start, end in zip(bounds, bounds[1:])
            for position in range(start, end)
            if _owner(position - start, end - start, cp) == rank
        ]
        assert index.dtype == torch.int32 and index.tolist() == expected
        seen += expected
    assert sorted(seen) == list(range(bounds[-1]))


def test_thd_partition_refuses_sequences_it_cannot_split():
    with pytest.raises(ValueError, match=r"length 6, not divisible by 2 \* cp = 4"):
        thd_get_partitioned_indices(torch.tensor([0, 6, 8]), 8, 2, 0)
    with pytest.raises(ValueError, match="must rise from 0 to total_tokens 12"):
        thd_get_partitioned_indices(torch.tensor([0, 4, 8]), 12, 2, 0)


def test_cpu_compat_gives_megatron_the_te_function_and_takes_it_back():
    from megatron.core import utils

    if utils.tex is not None:
        pytest.skip("Transformer Engine is installed: Megatron calls its own thd_get_partitioned_indices")
    patcher = Patcher()
    install_thd_partition(patcher, utils)
    try:
        assert utils.tex.thd_get_partitioned_indices is thd_get_partitioned_indices
    finally:
        patcher.revert()
    assert utils.tex is None


def test_packed_batch_restarts_positions_and_masks_every_sequence_unequally():
    batch = make_packed_global_batch(SEED, 8, 16, 128)
    plain = make_global_batch(SEED, 8, 16, 128)
    bounds = cu_seqlens_of(16).tolist()
    assert bounds == [0, 4, 12, 16]
    assert torch.equal(batch["tokens"], plain["tokens"]) and torch.equal(batch["labels"], plain["labels"])
    assert batch["cu_seqlens"].tolist() == [bounds] * 8
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, *range(8), 0, 1, 2, 3]
    assert not batch["loss_mask"][:, [end - 1 for end in bounds[1:]]].any()  # labels across a boundary
    per_sequence = torch.stack([batch["loss_mask"][:, a:b].sum(1) for a, b in zip(bounds, bounds[1:])], 1)
    assert len(set(per_sequence.sum(1).tolist())) > 3 and len(set(per_sequence.flatten().tolist())) > 3
    assert (per_sequence <= plain["loss_mask"].sum(1, keepdim=True)).all()
    cp_ranks = [thd_get_partitioned_indices(torch.tensor(bounds), 16, 2, rank).long() for rank in (0, 1)]
    per_cp_rank = torch.stack([batch["loss_mask"][:, index].sum(1) for index in cp_ranks], 1)
    assert (per_cp_rank[:, 0] != per_cp_rank[:, 1]).any()  # unequal valid tokens per CP rank too


def _reference(inputs: dict, bounds) -> tuple:
    """Causal attention of each sequence on its own (GQA), and the q / k / v grads of sum(out * weight)."""
    leaves = {name: inputs[name].clone().requires_grad_() for name in ("query", "key", "value")}
    outputs = []
    for start, end in zip(bounds, bounds[1:]):
        query = leaves["query"][start:end].transpose(0, 1)
        key, value = (leaves[name][start:end].repeat_interleave(HEADS // GROUPS, 1).transpose(0, 1)
                      for name in ("key", "value"))
        scores = query @ key.transpose(1, 2) / query.shape[-1] ** 0.5
        future = torch.triu(torch.ones(end - start, end - start, dtype=torch.bool), diagonal=1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        outputs.append((probs @ value).transpose(0, 1).reshape(end - start, 1, -1))
    output = torch.cat(outputs)
    (output * inputs["weight"]).sum().backward()
    return output.detach(), {name: leaf.grad for name, leaf in leaves.items()}


def _assemble(per_rank: list) -> tuple:
    total = CU_SEQLENS[-1]
    output = torch.zeros(total, 1, per_rank[0]["output"].shape[-1])
    grads = {name: torch.zeros(total, *grad.shape[1:]) for name, grad in per_rank[0]["grads"].items()}
    for record in per_rank:
        output[record["index"]] = record["output"]
        for name, grad in record["grads"].items():
            grads[name][record["index"]] = grad
    return output, grads


def _error(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    return float((candidate - reference).norm() / reference.norm())


@pytest.fixture(scope="module")
def packed_worlds() -> dict:
    return {cp: run_world(packed_attention_rank, cp, args=(SEED,), name=f"cp{cp}") for cp in (1, 2)}


@pytest.fixture(scope="module")
def packed_runs(packed_worlds) -> dict:
    return {cp: _assemble(per_rank) for cp, per_rank in packed_worlds.items()}


def test_testbed_splits_packed_rows_per_sequence_as_te_defines(packed_worlds):
    """Megatron-Core 0.19 splits through the `cpu_compat` stand-in; older releases through the testbed's own."""
    for rank, record in enumerate(packed_worlds[2]):
        testbed, definition = record["splits"]
        assert testbed.keys() == definition.keys() and "cu_seqlens" in testbed
        for key, value in testbed.items():
            assert torch.equal(value, definition[key]), (rank, key)
        assert testbed["tokens"].shape == (1, 8)
    first, second = (record["splits"][0]["position_ids"][0].tolist() for record in packed_worlds[2])
    assert first == [0, 3, 0, 1, 6, 7, 0, 3] and second == [1, 2, 2, 3, 4, 5, 1, 2]


@pytest.mark.parametrize("cp", [1, 2])
def test_packed_attention_equals_each_sequence_on_its_own(packed_runs, cp):
    output, grads = packed_runs[cp]
    expected_output, expected_grads = _reference(packed_inputs(SEED), CU_SEQLENS)
    assert _error(output, expected_output) < TOLERANCE
    for name, grad in grads.items():
        assert _error(grad, expected_grads[name]) < TOLERANCE, name


def test_attention_across_sequences_would_be_caught(packed_runs):
    output, _ = packed_runs[2]
    leaking, _ = _reference(packed_inputs(SEED), (0, CU_SEQLENS[-1]))
    assert _error(output, leaking) > 100 * TOLERANCE


def test_packed_formats_other_than_thd_are_refused(packed_worlds):
    assert packed_worlds[1][0]["refusal"] == (
        "ContextParallelDotProductAttention supports packed sequences in the 'thd' format only; got qkv_format='bshd'"
    )
