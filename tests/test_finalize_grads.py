"""The `finalize_grads` patch and `lora.grad_sync`, on real Megatron layers, DDP, schedule and optimizer over gloo.

The model is a column-parallel -> row-parallel pair of real Megatron layers (frozen) with
hand-tagged LoRA factors in the layouts of docs/architecture.md section 4: column A replicated / B
sharded, row A sharded / B replicated. The reference is the same logical computation on
full tensors in one process (world size 1), so the replicated factors' grads only match
it once their per-rank partial sums are SUMmed over TP.
"""

from __future__ import annotations

import pytest
import torch
from error_metrics import assert_all_within, relative_l2_error
from finalize_reference import REPLICATED, SHARDED, global_batch, grad_tolerance, reference, samples_of_dp_rank
from finalize_worker import _tp2_rank

from megatron_lora_patch.proof.testbed.launcher import run_world


@pytest.fixture(scope="module", params=[False, True], ids=["tp2", "tp2-sp"])
def tp2(request):
    return run_world(_tp2_rank, 2, kwargs={"sequence_parallel": request.param}, name=request.node.name)


@pytest.fixture(scope="module")
def tp1_reference():
    return reference(samples_of_dp_rank(global_batch(1), 0, 1))


def test_replicated_factor_grads_match_world1_after_finalize(tp2, tp1_reference):
    assert len(tp2) == 2
    for rank_result in tp2:
        assert_all_within(rank_result["patched"], tp1_reference["grads"], grad_tolerance(dp=1))


def test_without_the_patch_replicated_factor_grads_are_partial(tp2, tp1_reference):
    assert len(tp2) == 2
    expected = tp1_reference["grads"]
    for rank_result in tp2:
        # the replicated factors hold one rank's partial sum: the negative control, >= 100x the tolerance
        partial = {name: relative_l2_error(rank_result["unpatched"][name], expected[name]) for name in REPLICATED}
        assert min(partial.values()) > 100 * grad_tolerance(dp=1), partial
        # sharded factors never needed the extension
        assert_all_within(
            {name: rank_result["unpatched"][name] for name in SHARDED},
            {name: expected[name] for name in SHARDED},
            grad_tolerance(dp=1),
        )


def test_grad_norm_matches_world1(tp2, tp1_reference):
    expected = torch.sqrt(sum((g.double() ** 2).sum() for g in tp1_reference["grads"].values())).item()
    for rank_result in tp2:
        assert rank_result["grad_norm"] == pytest.approx(expected, rel=grad_tolerance(dp=1))


def test_one_all_reduce_per_bucket(tp2):
    for rank_result in tp2:
        assert rank_result["buckets"] == 1  # both replicated factors: one (tp group, sum, fp32, cpu) bucket
        mixed = rank_result["mixed_dtype"]
        # fp32 bucket (dense and expert TP: same ranks, other group objects), bf16 bucket reduced in fp32
        assert mixed["expert_tp_is_tp_ranks_other_group"]
        assert mixed["calls"] == [torch.float32, torch.float32]
        summed = 3 * (1 + 1 / 128)
        assert mixed["grads"]["f32"].tolist() == mixed["grads"]["f32b"].tolist() == [summed] * 3
        assert mixed["grads"]["expert"].tolist() == [summed] * 3
        assert mixed["grads"]["bf16"].tolist() == [torch.tensor(summed).to(torch.bfloat16).item()] * 3
        assert mixed["dtypes"]["bf16"] == torch.bfloat16
        assert mixed["grads"]["solo"].tolist() == [(1.0 + rank_result["rank"]) * (1 + 1 / 128)] * 3


def test_unset_finalize_func_is_reported(tp2):
    for rank_result in tp2:
        assert rank_result["missing_finalize"]["warned"]
        assert "finalize_model_grads_func" in rank_result["missing_finalize"]["strict_error"]
