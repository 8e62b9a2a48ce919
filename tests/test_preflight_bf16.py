"""The preflight's bf16 rule and where its ranks run (issue 34; proof/oracle/bf16_rule.py, preflight_device.py).

The rule on hand-made phases (no Megatron): each step is judged at FACTOR x the one-rank bf16 run's error so far
against fp32, never tighter than fp32's threshold, and not at all where that limit reaches 1. Then the CLI on CPU
with gloo in bf16, the code path a GPU node runs with NCCL: tp2 passes against the fp32 reference; the mutation
with the smallest measured bf16 margin fails; one rank with a mutation (the GPU device script's world-size-1 check)
fails. The device refusals are one line each, before any rank starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
import torch

if importlib.util.find_spec("megatron.training") is None:  # absent only: an import error in it must fail
    pytest.skip(
        "preflight parses with Megatron-LM's argument parser: megatron.training is absent (megatron-core < 0.17)",
        allow_module_level=True,
    )

from preflight_cases import DENSE, cli  # noqa: E402

from megatron_lora_patch.proof.oracle import preflight_device, thresholds  # noqa: E402
from megatron_lora_patch.proof.oracle.bf16_rule import FACTOR, RelativeLimits, relative_limits  # noqa: E402
from megatron_lora_patch.proof.oracle.phases import compare  # noqa: E402
from megatron_lora_patch.runtime.errors import UsageError  # noqa: E402

BF16 = [*DENSE, "--bf16"]
TP2 = ["--tensor-model-parallel-size", "2"]


def _off_by(reference: dict, errors: dict) -> dict:
    """`reference`'s phases with each key's value moved by its relative error in `errors` (default 0)."""
    return {
        phase: {key: value * (1 + errors.get(key, 0.0)) for key, value in values.items()}
        for phase, values in reference.items()
    }


FP32 = {
    "loss": {"step0.lm_loss": 2.0, "step1.lm_loss": 1.5},
    "grads": {"step0/w": torch.ones(4), "step1/w": torch.ones(4)},
    "deltas": {"w": torch.ones(4)},
}
#: The one-rank bf16 run: loss off by 1e-3 at step 0 and only 1e-4 at step 1 (a dip), grads exact, deltas 50 % off.
ONE_RANK = _off_by(FP32, {"step0.lm_loss": 1e-3, "step1.lm_loss": 1e-4, "w": 0.5})


def test_limits_follow_the_one_rank_error_so_far_with_fp32_as_the_floor():
    limits = relative_limits(ONE_RANK, FP32, steps=2)
    assert limits.threshold("loss", 0) == pytest.approx(FACTOR * 1e-3)
    assert limits.threshold("loss", 1) == pytest.approx(FACTOR * 1e-3)  # the envelope, not step 1's dip
    assert limits.threshold("grads", 0) == FACTOR * thresholds.threshold("fp32", "grads", 0)  # exact: fp32's floor
    assert limits.threshold("deltas", 1) is None  # FACTOR x 0.5 >= 1: bf16 alone is as far off as a bug
    assert limits.noise[("deltas", 1)] == pytest.approx(0.5)


def test_a_topology_within_the_factor_passes_and_beyond_it_fails():
    limits = relative_limits(ONE_RANK, FP32, steps=2)
    within = _off_by(FP32, {"step0.lm_loss": 0.8 * FACTOR * 1e-3, "step1.lm_loss": 0.8 * FACTOR * 1e-3})
    assert compare(within, FP32, limits)["loss"].passed
    beyond = _off_by(FP32, {"step0.lm_loss": 1.2 * FACTOR * 1e-3})
    assert not compare(beyond, FP32, limits)["loss"].passed
    # The rule's mutation: each step judged by its own one-rank error (no envelope) fails this run at step 1's dip.
    per_step = RelativeLimits(2, {("loss", 0): FACTOR * 1e-3, ("loss", 1): FACTOR * 1e-4}, {})
    assert not compare(within, FP32, per_step)["loss"].passed


def test_a_nan_in_the_one_rank_run_is_an_error_not_a_free_pass():
    with pytest.raises(ValueError, match="NaN in loss at step 0"):
        relative_limits(_off_by(FP32, {"step0.lm_loss": float("nan")}), FP32, steps=2)


def test_tp2_bf16_passes_against_fp32_and_the_weakest_mutation_fails(tmp_path):
    """xavier_fan_in_local_shard has the smallest measured bf16 margin (8.2x); the control must fail by >= 4x."""
    passed, failed = tmp_path / "passed.json", tmp_path / "failed.json"
    result = cli("--device", "cpu", "--json", str(passed), "--", *BF16, *TP2, tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert f"within {FACTOR:g}x the one-rank bf16 run's own error" in result.stdout
    report = json.loads(passed.read_text())
    noise, limits = report["settings"]["bf16_noise"], report["settings"]["thresholds"]
    assert 0 < noise["forward step 0"]
    assert limits["forward"]["step 0"] == pytest.approx(FACTOR * noise["forward step 0"])
    (row,) = report["topologies"]
    assert set(row["phases"]) >= {"forward", "loss", "grads", "grad_norm"}
    result = cli("--device", "cpu", "--json", str(failed), "--mutation", "xavier_fan_in_local_shard", "--", *BF16, *TP2,
                 tmp_path=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert json.loads(failed.read_text())["drift"]["over_threshold"] >= 4


def test_one_rank_with_a_mutation_fails_as_the_gpu_script_checks(tmp_path):
    """World size 1 compares the run's own kernels with fp32: a mutation that bites on one rank must fail (>= 10x)."""
    report_path = tmp_path / "preflight.json"
    result = cli("--device", "cpu", "--json", str(report_path), "--data-parallel-size", "1", "--mutation",
                 "wrong_qkv_packing", "--", *BF16, tmp_path=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert json.loads(report_path.read_text())["drift"]["over_threshold"] >= 10


def _args(**overrides) -> argparse.Namespace:
    values = dict(transformer_impl="local", gradient_accumulation_fusion=False, no_persist_layer_norm=True,
                  masked_softmax_fusion=False)
    return argparse.Namespace(**{**values, **overrides})


def test_device_refusals_are_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="--device cuda: torch sees no CUDA device"):
        preflight_device.resolve_device("cuda")
    assert preflight_device.resolve_device("auto") == "cpu"
    with pytest.raises(UsageError, match="nothing to compare with world size 1"):
        preflight_device.check_world(1, "cpu", None, _args())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UsageError, match="runs 2 ranks and this node has 1 GPU"):
        preflight_device.check_world(2, "cuda", None, _args())
    preflight_device.check_world(1, "cuda", None, _args())  # every kernel off: nothing to refuse


@pytest.mark.parametrize(
    "overrides, fix",
    [
        ({"transformer_impl": "transformer_engine"}, "add --transformer-impl local"),
        ({"gradient_accumulation_fusion": True}, "add --no-gradient-accumulation-fusion"),
        ({"no_persist_layer_norm": False}, "add --no-persist-layer-norm"),
        ({"masked_softmax_fusion": True}, "add --no-masked-softmax-fusion"),
    ],
)
def test_a_kernel_this_node_lacks_is_refused_naming_the_flag(monkeypatch, overrides, fix):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(preflight_device, "_importable", lambda module: False)
    with pytest.raises(UsageError, match=fix) as caught:
        preflight_device.check_world(1, "cuda", None, _args(**overrides))
    assert "\n" not in str(caught.value)
