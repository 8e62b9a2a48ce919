"""The `loss_normalization` patch: DP runs equal world-1's global token mean, never a mean of means.

Every microbatch of every DP rank holds a different number of trainable tokens, so the
mean-of-means result is measurably different from the global token mean (checked too, so
a regression would be caught). The model and reference are those of test_finalize_grads.
"""

from __future__ import annotations

import logging

import pytest
from error_metrics import assert_all_within, relative_l2_error
from finalize_reference import global_batch, grad_tolerance, reference, samples_of_dp_rank
from finalize_worker import apply_patches, build_ddp_model, gather_logical, mean_loss_func, train_step

from megatron_lora_patch.proof.testbed.launcher import run_world


def _dp_rank(rank: int, world_size: int, spec: str, tp: int) -> dict:
    from megatron.core import parallel_state

    from megatron_lora_patch.proof.testbed.topology import Topology

    apply_patches(finalize=True, loss=True)
    with Topology.parse(spec).world(cpu_compat=False):
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        samples = samples_of_dp_rank(global_batch(dp), dp_rank, dp)
        model, config = build_ddp_model(tp=tp)
        patched = train_step(model, samples)
        result = {"patched": gather_logical(patched["grads"]), "report": patched["report"],
                  "average_in_collective": model.ddp_config.average_in_collective}
        result["legacy"] = legacy_loss_reports(model, samples)
        apply_patches(finalize=True, loss=False)
        model, config = build_ddp_model(tp=tp)
        result["unpatched"] = gather_logical(train_step(model, samples)["grads"])
    return result


def legacy_loss_reports(model, samples) -> dict:
    """A 2-tuple loss function: one warning in normal mode, a RuntimeError in strict mode."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron_lora_patch").addHandler(handler)
    train_step(model, samples, loss_func=mean_loss_func)
    train_step(model, samples, loss_func=mean_loss_func)
    warnings = [r.getMessage() for r in records if "legacy 2-tuple" in r.getMessage()]
    apply_patches(finalize=True, loss=True, strict=True)
    try:
        train_step(model, samples, loss_func=mean_loss_func)
        strict_error = None
    except RuntimeError as error:
        strict_error = str(error)
    finally:
        apply_patches(finalize=True, loss=True, strict=False)
    return {"warnings": warnings, "strict_error": strict_error}


def _check(results: list, dp: int) -> None:
    samples = global_batch(dp)
    expected = reference(samples)
    mean_of_means = reference(samples, mean_of_means_dp=dp)
    tolerance = grad_tolerance(dp)
    # the bug the patch removes differs from the token mean by >= 100x the tolerance on every factor
    bug = {name: relative_l2_error(mean_of_means["grads"][name], grad) for name, grad in expected["grads"].items()}
    assert min(bug.values()) > 100 * tolerance, bug
    for result in results:
        assert result["average_in_collective"] is False
        assert_all_within(result["patched"], expected["grads"], tolerance)
        # the bug reproduced on the same data: Megatron's default is a mean of means
        assert_all_within(result["unpatched"], mean_of_means["grads"], tolerance)
        loss_sum, tokens = result["report"].tolist()
        assert loss_sum / tokens == pytest.approx(expected["loss"], rel=1e-6)
        assert len(result["legacy"]["warnings"]) == 1
        assert "(sum of per-token losses" in result["legacy"]["warnings"][0]
        assert "MEGATRON_LORA_STRICT" in result["legacy"]["strict_error"]


def test_dp2_equals_world1_global_token_mean():
    _check(run_world(_dp_rank, 2, kwargs={"spec": "dp2", "tp": 1}, name="dp2"), dp=2)


@pytest.mark.slow
def test_dp2_tp2_equals_world1_global_token_mean():
    _check(run_world(_dp_rank, 4, kwargs={"spec": "tp2-dp2", "tp": 2}, name="tp2-dp2"), dp=2)
