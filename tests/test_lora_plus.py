"""LoRA+ (`MEGATRON_LORA_PLUS_RATIO`, the `lora_plus` patch) through Megatron's own optimizer build, on DP2 with
the plain and the distributed optimizer: B's learning rate is the ratio times A's (the step shows it: B moves
`ratio` times as far as at ratio 1, A as far), a cosine schedule scales both bounds, and a save / resume of model
and optimizer keeps the groups' rates (the resumed step equals the uninterrupted one). Megatron-LM's training loop
reaches the patched builder through the name its module imported.
"""

from __future__ import annotations

import pytest
import torch
from lora_plus_worker import MAX_LR, MIN_LR, deltas_world, resume_world

from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec

SPEC = TinyGPTSpec()
RATIO = 4.0
#: relative error of a ratio read off two Adam steps from the same grads (fp32 rounding of lr * update)
TOLERANCE = 1e-4


def _moves(rank_record: dict) -> dict:
    """(module, factor) -> the factor's change over the step, per ratio."""
    return {
        (before["name"], factor): after[factor] - before[factor]
        for before, after in zip(rank_record["before"], rank_record["after"])
        for factor in "AB"
    }


def test_megatron_lm_training_calls_the_patched_builder():
    """`megatron.training.training` imports `get_megatron_optimizer` by name (before the patch here): its
    `setup_model_and_optimizer` must build through the patch, and gets the original back on revert."""
    pytest.importorskip("megatron.training", reason="Megatron-LM's training loop ships with Megatron-Core 0.17+")
    import megatron.core.optimizer as optimizer
    from megatron.training import training

    import megatron_lora_patch
    from megatron_lora_patch.proof.testbed.patches import apply_only

    original = optimizer.get_megatron_optimizer
    apply_only(["lora_plus"])
    try:
        assert training.get_megatron_optimizer is optimizer.get_megatron_optimizer is not original
        assert training.get_megatron_optimizer.__wrapped__ is original
    finally:
        megatron_lora_patch.revert()
    assert training.get_megatron_optimizer is optimizer.get_megatron_optimizer is original


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distributed"])
def test_b_steps_ratio_times_as_far_as_at_ratio_one(distributed):
    ranks = run_world(deltas_world, 2, name="dp2", timeout=300, args=("dp2", SPEC, distributed))
    for record in ranks:
        assert record[1.0]["lrs"] == pytest.approx([MAX_LR] * len(record[1.0]["lrs"]), rel=1e-12)
        assert record[RATIO]["lrs"][0] == pytest.approx(MAX_LR, rel=1e-12)
        assert record[RATIO]["lrs"][-1] == pytest.approx(RATIO * MAX_LR, rel=1e-12), record[RATIO]["lrs"]
        plain, plus = _moves(record[1.0]), _moves(record[RATIO])
        assert plain and plain.keys() == plus.keys()
        for (name, factor), moved in plain.items():
            expected = RATIO * moved if factor == "B" else moved
            error = (torch.linalg.norm(plus[name, factor] - expected) / torch.linalg.norm(expected)).item()
            assert moved.abs().max() > 0 and error < TOLERANCE, (name, factor, error)
        refusal = record["refusal"]  # the caller's own rate on B (0.16+: max_lr; 0.13-0.15: lr_mult)
        assert refusal.startswith("LoraConfig.plus_ratio=4 (LoRA+) ") and "\n" not in refusal, refusal
        assert refusal.endswith("unset LoraConfig.plus_ratio or leave the LoRA factors out of that override") or (
            refusal.endswith("unset LoraConfig.plus_ratio or drop the caller's scale_lr_cond")
        ), refusal


def test_schedule_and_resume_keep_the_ratio(tmp_path):
    ranks = run_world(resume_world, 2, name="dp2", timeout=300, args=("dp2", SPEC, False, str(tmp_path)))
    for record in ranks:
        saved, resumed = record["saved"], record["resumed"]
        low, high = saved["lrs"][0], saved["lrs"][-1]
        assert MIN_LR < low < MAX_LR and high == pytest.approx(RATIO * low, rel=1e-12), saved["lrs"]
        assert resumed["lrs"] == saved["lrs"]
        for end, again in zip(saved["end"], resumed["end"]):
            for factor in "AB":
                assert torch.allclose(end[factor], again[factor], rtol=1e-5, atol=1e-7), (end["name"], factor)
