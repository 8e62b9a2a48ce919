"""`megatron-lora-patch preflight` on hybrid models (`--hybrid-layer-pattern`, Megatron-Core's HybridModel, 0.18+).

The dense widths of `preflight_cases.DENSE` with an attention / MLP (and MoE) layer pattern, two ranks,
2 steps: the user's topology must match world-1 with the depth cut to one layer of each kind, and with one
of the oracle's mutations active the preflight must fail by >= 100x and name the layer. Mamba layers and a
Megatron-Core without HybridModel stop with one line. This file also runs on the older minors
(scripts/run-tests.sh VERSIONED_TESTS): each case runs where it applies, and is "not applicable" elsewhere.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import assert_one_line_error
from preflight_cases import DENSE, TP2_SP, assert_passed, cli, options, user_environ  # noqa: F401 (fixture)

from megatron_lora_patch.proof.oracle import preflight, preflight_run
from megatron_lora_patch.runtime.errors import UsageError

HAS_HYBRID_MODEL = importlib.util.find_spec("megatron.core.models.hybrid") is not None
needs_hybrid_model = pytest.mark.skipif(
    not HAS_HYBRID_MODEL, reason="not applicable to this Megatron-Core: HybridModel arrived in 0.18"
)
HYBRID = [*DENSE, "--hybrid-layer-pattern", "*-*-"]  # sets --num-layers 4 (Megatron-LM derives it from the pattern)
#: Attention, MLP, attention, MoE (4 experts, top-2): the preflight keeps '*-E'.
MOE_HYBRID = [
    *DENSE,
    "--hybrid-layer-pattern",
    "*-*E",
    *"--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64".split(),
]


@needs_hybrid_model
def test_hybrid_tp2_sp_passes_says_the_kept_pattern_and_a_skipped_tp_sum_names_the_layer(user_environ, tmp_path):
    """The CLI: exit 0 with the kept pattern printed and in the JSON; then the negative control (the column A's
    TP SUM left out) fails >= 100x on the attention layer's linear_qkv."""
    report_path = tmp_path / "preflight.json"
    result = cli("--json", str(report_path), "--", *HYBRID, *TP2_SP, tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "layers: 2 of your 4 (every layer kind once: 0: attention, 1: mlp); widths unchanged" in result.stdout
    assert "hybrid layer pattern: '*-' of your '*-*-'" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("PASS: 1/1 topologies match world-1")
    report = json.loads(report_path.read_text())
    assert report["preflight"]["layers"]["hybrid_pattern"] == {"yours": "*-*-", "kept": "*-"}
    assert report["topologies"][0]["model"] == "hybrid"
    failed = preflight_run.run_plan(preflight.make_plan(options([*HYBRID, *TP2_SP], mutation="skip_tp_sum_column_a")))
    assert not failed.passed and failed.drift["over_threshold"] >= 100, failed.table()
    assert failed.drift["layer"] == 0 and failed.drift["layer_kind"] == "attention", failed.drift
    assert "self_attention.linear_qkv" in failed.drift["parameter"]


@needs_hybrid_model
def test_hybrid_pp2_splits_the_kept_pattern_at_the_stage_boundary_and_passes(user_environ):
    plan = preflight.make_plan(options([*HYBRID, "--pipeline-model-parallel-size", "2"]))
    assert plan.spec.hybrid_pattern == "*|-"
    report = preflight_run.run_plan(plan)
    assert_passed(report, "pp2", ["attention", "mlp"])
    assert {"0", "1"} <= set(report.topologies[0].phases["grads"].per_layer)  # both stages' layers compared


@needs_hybrid_model
def test_moe_hybrid_tp2_etp2_sp_passes_and_a_skipped_expert_sum_names_the_moe_layer(user_environ):
    arguments = [*MOE_HYBRID, *TP2_SP, "--expert-tensor-parallel-size", "2"]
    plan = preflight.make_plan(options(arguments))
    assert plan.spec.hybrid_pattern == "*-E"
    assert_passed(preflight_run.run_plan(plan), "tp2-etp2-sp", ["attention", "mlp", "moe"])
    report = preflight_run.run_plan(preflight.make_plan(options(arguments, mutation="skip_expert_tp_sum")))
    assert not report.passed and report.drift["over_threshold"] >= 100, report.table()
    assert report.drift["layer"] == 2 and report.drift["layer_kind"] == "moe", report.drift
    assert "experts" in report.drift["parameter"]


MAMBA_REFUSAL = (
    "preflight cannot build the Mamba (M) layers of --hybrid-layer-pattern '{pattern}': its ranks run on CPU, where "
    "their mixers' kernels (mamba_ssm, causal_conv1d) do not run, and LoRA does not adapt mixer linears (it refuses "
    "them as targets); {fix}"
)


@needs_hybrid_model
def test_mamba_layers_are_one_line_exit_2_naming_the_pattern_to_check_instead(tmp_path):
    result = cli("--", *DENSE, *TP2_SP, "--hybrid-layer-pattern", "M*M-", tmp_path=tmp_path)
    fix = "check the attention / MLP / MoE layers it adapts with --hybrid-layer-pattern '*-' (yours without M)"
    assert_one_line_error(result, MAMBA_REFUSAL.format(pattern="M*M-", fix=fix), returncode=2)


@needs_hybrid_model
@pytest.mark.parametrize(
    "pattern, message",
    [
        (
            "MMMM",
            MAMBA_REFUSAL.format(
                pattern="MMMM", fix="your pattern has no attention / MLP / MoE layer for LoRA to adapt"
            ),
        ),
        (
            "G*G-",
            "preflight cannot build the gated delta net (G) layers of --hybrid-layer-pattern 'G*G-': its ranks run "
            "on CPU, where their mixers' kernels (fla) do not run, and LoRA does not adapt mixer linears "
            "(it refuses them as targets); check the attention / MLP / MoE layers it adapts with "
            "--hybrid-layer-pattern '*-' (yours without G)",
        ),
        (
            "*-*-/*-",
            "preflight does not support multi-token prediction layers yet: drop the MTP part ('/*-...') of "
            "--hybrid-layer-pattern for the preflight",
        ),
    ],
)
def test_unbuildable_hybrid_layers_are_one_usage_error(user_environ, pattern, message):
    with pytest.raises(UsageError) as caught:
        preflight.make_plan(options([*DENSE, *TP2_SP, "--hybrid-layer-pattern", pattern]))
    assert str(caught.value) == message


@pytest.mark.skipif(HAS_HYBRID_MODEL, reason="not applicable to this Megatron-Core: it has HybridModel (0.18+)")
def test_megatron_core_without_hybrid_model_is_one_line_exit_2(tmp_path):
    """Before 0.18 (no HybridModel) a hybrid pattern stops with one line; without megatron.training (< 0.17)
    the preflight's own parser requirement says so first."""
    result = cli("--", *HYBRID, *TP2_SP, tmp_path=tmp_path)
    if importlib.util.find_spec("megatron.training") is None:
        message = "preflight needs Megatron-LM's argument parser (megatron.training, in megatron-core >= 0.17): "
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
        return
    assert_one_line_error(
        result,
        (
            "preflight builds --hybrid-layer-pattern models as Megatron-Core's HybridModel, which needs megatron-core "
            ">= 0.18; upgrade megatron-core, or drop --hybrid-layer-pattern to check a GPT model"
        ),
        returncode=2,
    )
