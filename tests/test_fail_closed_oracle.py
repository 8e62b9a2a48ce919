"""Fail closed, oracle edition: every bad `megatron-lora-patch oracle` input is ONE line and exit 2
before any world is spawned, and the oracle's verdicts cannot be fooled by its own options.

Each bad input runs through `cli.main` as a user would type it (`run_in_process`); a misspelled
MEGATRON_PLUGINS, a missing matplotlib and the two runs at the end (a failed reference run, and --steps 10
on tp2/tp2-sp) run in fresh processes. No test here spawns a world except those two runs.
"""

from __future__ import annotations

import json
import math
import pathlib
import textwrap

import pytest
from conftest import assert_one_line_error, run_fresh, run_in_process

from megatron_lora_patch.proof.oracle import harness
from megatron_lora_patch.proof.oracle.metrics import PhaseMetrics, compare_tensors
from megatron_lora_patch.proof.oracle.mutations import MUTATIONS
from megatron_lora_patch.proof.testbed.topology import Topology, TopologyError
from megatron_lora_patch.runtime.errors import UsageError

ORACLE = ["-m", "megatron_lora_patch", "oracle"]
TP3 = (
    "topology 'tp3' does not fit the model: num_attention_heads=8, num_query_groups=4, vocab_size=128, "
    "ffn_hidden_size=128 are not divisible by tp3; use tp in {1, 2, 4}"
)

TIMEOUT = "--timeout must be a number of seconds above 0 and at most 604800 (a week), got {}"
BAD_INPUTS = {
    "steps-zero": (["--steps", "0"], "--steps must be an integer from 1 to 20, got '0'"),
    "steps-word": (["--steps", "ten"], "--steps must be an integer from 1 to 20, got 'ten'"),
    "steps-beyond-calibration": (["--steps", "21"], "--steps must be an integer from 1 to 20, got '21'"),
    "seed-negative": (["--seed", "-1"], "--seed must be an integer from 0 to 2147483647, got '-1'"),
    "seed-beyond-numpy": (["--seed", str(2**32)], f"--seed must be an integer from 0 to 2147483647, got '{2**32}'"),
    "timeout-negative": (["--timeout", "-1"], TIMEOUT.format("'-1'")),
    "timeout-nan": (["--timeout", "nan"], TIMEOUT.format("'nan'")),
    "timeout-overflowing": (["--timeout", "1e9"], TIMEOUT.format("'1e9'")),  # was an OverflowError traceback
    "json-missing-dir": (
        ["--json", "/nonexistent-dir/r.json"],
        "--json /nonexistent-dir/r.json: /nonexistent-dir does not exist; create the directory or choose another path",
    ),
    "json-unwritable-dir": (
        ["--json", "/sys/r.json"],
        "--json /sys/r.json: cannot write in /sys (Permission denied); choose another path",
    ),
    "json-under-a-file": (
        ["--json", "/etc/hostname/r.json"],
        "--json /etc/hostname/r.json: /etc/hostname is not a directory; create the directory or choose another path",
    ),
    "json-is-a-directory": (
        ["--json", "/tmp"],
        "--json /tmp: is a directory; give a file path such as /tmp/oracle.out",
    ),
    "plot-not-png": (
        ["--plot", "/tmp/heat.txt"],
        "--plot /tmp/heat.txt: the heat map is a PNG; give a path ending in .png",
    ),
    "plot-missing-dir": (
        ["--plot", "/nonexistent-dir/heat.png"],
        "--plot /nonexistent-dir/heat.png: /nonexistent-dir does not exist; "
        "create the directory or choose another path",
    ),
    "topology-tp3": (["--topologies", "tp3"], TP3),
    "topology-tp8-query-groups": (
        ["--topologies", "tp2,tp8"],
        "topology 'tp8' does not fit the model: num_query_groups=4 is not divisible by tp8; use tp in {1, 2, 4}",
    ),
    "topology-ep3-experts": (
        ["--topologies", "ep3"],
        "topology 'ep3' does not fit the model: num_experts=4 is not divisible by ep3; use an ep dividing 4",
    ),
    "topology-pp3-layers": (
        ["--topologies", "pp3"],
        "topology 'pp3' does not fit the model: num_layers=4 is not divisible by pp3; use a pp dividing 4",
    ),
    "topology-etp3-expert-ffn": (
        ["--topologies", "ep2-etp3"],
        "topology 'ep2-etp3' does not fit the model: moe_ffn_hidden_size=128 is not divisible by etp3; "
        "use etp in {1, 2, 4, 8}",
    ),
    "topology-typo": (
        ["--topologies", "tp2-sq"],
        "invalid topology spec 'tp2-sq': unknown part 'sq'; expected dash-separated parts "
        "(tpN, ppN, cpN, dpN, epN, etpN, sp), "
        "e.g. 'tp2-sp', 'dp2', 'pp2', 'ep2', 'tp2-ep2-etp2-sp', 'tp2-dp2', 'cp2', 'tp1'",
    ),
    "topology-twice": (["--topologies", "tp2,dp2,tp2"], "--topologies lists 'tp2' twice; give each once"),
    "topology-world-1": (
        ["--topologies", "tp1"],
        "--topologies: 'tp1' is the world-1 reference itself; list topologies of 2 or more ranks",
    ),
    "topologies-empty": (["--topologies", ","], "--topologies needs default, all or a comma list; got ','"),
    "dense-model-with-experts": (
        ["--model", "dense", "--topologies", "ep2"],
        "topology ep2 shards experts but --model dense has none; use --model auto, moe or deepseek",
    ),
    "mla-model-with-experts": (
        ["--model", "mla", "--topologies", "ep2"],
        "topology ep2 shards experts but --model mla has none; use --model auto, moe or deepseek",
    ),
    "moe-model-tp-without-sp": (
        ["--model", "deepseek", "--topologies", "tp2"],
        "--model deepseek on tp2: Megatron-Core trains MoE layers under tensor parallelism only with sequence "
        "parallelism; use tp2-sp",
    ),
    "mla-model-layout-invariant": (
        ["--model", "mla", "--layout-invariant", "--topologies", "tp2"],
        "--layout-invariant does not cover --model mla: its bitwise reduction order has not been proven on MLA's "
        "latent projections (docs/architecture.md section 7); run --model mla without --layout-invariant",
    ),
    "deepseek-model-layout-invariant": (
        ["--model", "deepseek", "--layout-invariant", "--topologies", "tp2"],
        "--layout-invariant does not cover --model deepseek: moe_shared_expert_intermediate_size=64: shared experts "
        "are not proven bit-exact yet; drop them; moe_router_enable_expert_bias=True: the expert-bias update is not "
        "proven bit-exact yet; turn it off; its bitwise reduction order has not been proven on MLA's latent "
        "projections (docs/architecture.md section 7); run --model deepseek without --layout-invariant",
    ),
    "mutation-unknown": (
        ["--mutations", "skip_tp_sum"],
        f"unknown mutation 'skip_tp_sum'; known: {', '.join(MUTATIONS)}",
    ),
    "layout-invariant-with-cp": (
        ["--layout-invariant", "--topologies", "cp2"],
        "--layout-invariant covers tp, sp, dp, pp, ep and etp; cp2 also uses cp: use topologies like tp2, tp2-sp, "
        "dp2, pp2, tp2-dp2, ep2, ep2-etp2, tp2-ep2-sp",
    ),
    "layout-invariant-with-dp3": (
        ["--layout-invariant", "--topologies", "dp3"],
        "--layout-invariant needs a dp dividing 8 (1, 2, 4, 8); dp3 has dp3",
    ),
    "layout-invariant-with-mutations": (
        ["--layout-invariant", "--topologies", "tp2", "--mutations", "all"],
        "--layout-invariant runs without mutations: they re-introduce bugs the invariant mode bypasses; "
        "drop --mutations",
    ),
    "packed-with-layout-invariant": (
        ["--layout-invariant", "--data", "packed", "--topologies", "tp2"],
        "--layout-invariant is not proven on packed data yet (its layouts are checked on unpacked rows); "
        "run it with --data unpacked",
    ),
    "packed-over-cp4": (
        ["--data", "packed", "--topologies", "cp4"],
        "--data packed splits each packed sequence into 2 * cp chunks, up to cp2; cp4 has cp4: use cp2 or less",
    ),
    "packed-hybrid-model": (
        ["--data", "packed", "--model", "hybrid", "--topologies", "tp2"],
        "--data packed runs the dense and MoE models; use --model dense, moe or auto",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_oracle_input_is_one_line_before_any_world(case):
    arguments, message = BAD_INPUTS[case]
    result = run_in_process(["oracle", *arguments])
    assert_one_line_error(result, message, returncode=2)
    assert result.stdout == ""  # no table, no verdict: nothing ran


@pytest.mark.parametrize("options, message", [
    (["--json", "/nonexistent/x.json"],
     "--json /nonexistent/x.json: /nonexistent does not exist; create the directory or choose another path"),
    (["--timeout", "1e9"], TIMEOUT.format("'1e9'")),
])
def test_preflight_checks_its_report_path_and_timeout_before_any_run(tmp_path, options, message):
    """Was: 80 s of training, PASS, then a FileNotFoundError traceback (--json); an OverflowError (--timeout)."""
    dense = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
             "--micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters 10 --mock-data "
             "--tokenizer-type NullTokenizer --vocab-size 128 --tensor-model-parallel-size 2").split()
    result = run_in_process(["preflight", *options, "--", *dense])
    assert_one_line_error(result, message, returncode=2)
    assert result.stdout == ""  # no plan summary: nothing ran


@pytest.mark.parametrize("value", ["0", "-1", "many"])
def test_preflight_parameter_budget_must_be_a_positive_number(value):
    """--max-parameters (the CPU time budget the preflight cuts the model to) is refused by argparse, exit 2."""
    result = run_in_process(["preflight", "--max-parameters", value, "--", "--num-layers", "2"])
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        f"error: argument --max-parameters: must be a positive number, got {value!r}"
    )


def test_misspelled_megatron_plugins_is_one_line_before_any_world():
    """The ranks inherit MEGATRON_PLUGINS and their start-up hook would stop them with a rank traceback
    each: the oracle checks it first (as the preflight does). Control: a valid value passes that check."""
    result = run_fresh(ORACLE + ["--topologies", "tp2"], MEGATRON_PLUGINS="lora_corect")
    message = "MEGATRON_PLUGINS names unknown plugin 'lora_corect'; did you mean 'lora_correct'?"
    assert_one_line_error(result, message, returncode=2)
    assert result.stdout == ""
    result = run_fresh(ORACLE + ["--topologies", "tp1"], MEGATRON_PLUGINS="lora_correct,cpu_testbed")
    message = "--topologies: 'tp1' is the world-1 reference itself; list topologies of 2 or more ranks"
    assert_one_line_error(result, message, returncode=2)


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    shadow = tmp_path / "matplotlib"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    result = run_fresh(ORACLE + ["--plot", str(tmp_path / "heat.png")], PYTHONPATH=str(tmp_path))
    assert_one_line_error(result, "--plot needs matplotlib: pip install 'megatron-lora-patch[plot]'", returncode=2)


def test_oracle_input_errors_are_usage_errors_in_process(capsys):
    """Library callers can catch them as UsageError; cli.main prints the one line and returns 2."""
    from megatron_lora_patch import cli

    assert issubclass(harness.OracleError, UsageError) and issubclass(TopologyError, UsageError)
    assert cli.main(["oracle", "--topologies", "tp3"]) == 2
    assert capsys.readouterr().err == f"megatron-lora-patch: error: {TP3}\n"


@pytest.mark.parametrize("model", ["mla", "deepseek"])
def test_mla_models_on_megatron_core_0_13_are_one_line(monkeypatch, model):
    """0.13's MLA config has no YaRN original_max_position_embeddings: refused before any world (measured: the
    world-1 build raised a TypeError there)."""
    from megatron_lora_patch.proof.oracle import settings

    monkeypatch.setattr(settings, "_megatron_core_version", lambda: (0, 13))
    with pytest.raises(harness.OracleError) as refused:
        harness.check_topology(Topology.parse("dp2"), harness.OracleSettings(model=model))
    assert str(refused.value) == (
        f"--model {model} needs Megatron-Core 0.14 or newer (the testbed's MLA sets YaRN's "
        "original_max_position_embeddings, which 0.13 lacks); use --model dense or moe"
    )
    monkeypatch.setattr(settings, "_megatron_core_version", lambda: (0, 14))
    harness.check_topology(Topology.parse("dp2"), harness.OracleSettings(model=model))


def test_dora_on_moe_topologies_is_one_line_before_any_world():
    """DoRA's `--topologies all` (issue 37 item 3): expert topologies refuse DoRA up front (the build would refuse it
    on the experts in every rank); with the experts excluded, or on a dense topology, it is accepted."""
    dora = harness.OracleSettings(lora_options=(("dora", True),))
    with pytest.raises(harness.OracleError) as refused:
        harness.check_topology(Topology.parse("ep2"), dora)
    assert str(refused.value) == (
        "DoRA on ep2 (--model moe): DoRA on MoE experts is not supported; run DoRA on the dense model (topologies "
        "without ep / etp) or exclude the experts (exclude=('*experts*',))"
    )
    excluded = harness.OracleSettings(lora_options=(("dora", True), ("exclude", ("*experts*",))))
    harness.check_topology(Topology.parse("ep2"), excluded)
    harness.check_topology(Topology.parse("tp2"), dora)


def _phase(rel_l2: float, threshold: float) -> PhaseMetrics:
    return PhaseMetrics(rel_l2, rel_l2, "t", {}, threshold)


def test_no_phase_passes_at_relative_error_one_or_on_all_zero_tensors():
    import torch

    assert not _phase(1.0, 5.0).passed and not _phase(math.nan, 1.0).passed and _phase(0.5, 0.6).passed
    reference = {"a": torch.ones(3), "b": torch.full((2,), 2.0)}
    zero_candidate = compare_tensors({"a": torch.zeros(3), "b": torch.full((2,), 2.0)}, reference, 0.9)
    assert zero_candidate.rel_l2 == 1.0 and not zero_candidate.passed
    with pytest.raises(ValueError, match="nothing to compare: every reference tensor is zero"):
        compare_tensors({"a": torch.zeros(3)}, {"a": torch.zeros(3)}, 0.1)


REFERENCE_CRASH = textwrap.dedent(
    """
    import sys, dataclasses
    import oracle_faults
    from megatron_lora_patch import cli
    from megatron_lora_patch.proof.oracle import harness

    real = harness.make_job

    def make_job(topology, settings, mutation=None):
        job = real(topology, settings, mutation)
        return dataclasses.replace(job, context=oracle_faults.crashing_context) if topology.world_size == 1 else job

    harness.make_job = make_job
    sys.exit(cli.main(["oracle", "--topologies", "dp2", "--steps", "1", "--json", sys.argv[1]]))
    """
)


def test_failed_reference_is_a_verdict_and_a_traceback_tail(tmp_path):
    """World-1 crashes: no table, no 2-rank world, the rank's traceback tail and one FAIL line."""
    report_path = tmp_path / "r.json"
    result = run_fresh(["-c", REFERENCE_CRASH, str(report_path)], PYTHONPATH=str(pathlib.Path(__file__).parent))
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    assert lines[-1].startswith(
        "FAIL: the world-1 reference run of the dense model failed, so nothing was compared ("
    ), lines
    assert "RuntimeError: injected failure in the reference" in result.stdout
    assert len(lines) <= 20 and "ranks  model" not in result.stdout  # a tail, not 400 lines; no table
    document = json.loads(report_path.read_text())
    assert document["passed"] is False and "injected failure in the reference" in document["reference_error"]
    assert document["topologies"] == []


def test_steps_10_passes_on_tp2_quietly_with_a_titled_table(tmp_path):
    """`--steps 10` on correct code FAILed tp2 and tp2-sp (2-step thresholds); Megatron/torch
    warnings drowned the table; the header named no metric, model, dtype or steps; wall_s was 0."""
    report_path = tmp_path / "r.json"
    result = run_fresh(ORACLE + ["--topologies", "tp2,tp2-sp", "--steps", "10", "--json", str(report_path)])
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("relative L2 error vs world-1, ||run - world1|| / ||world1||, of the worst tensor"), (
        lines
    )
    assert lines[1] == (
        "dtype fp32, 10 steps, seed 1234; models dense: 4 layers, hidden 64, 8 heads / 4 query groups, seq 16"
    )
    assert lines[-1].startswith("PASS: 2/2 topologies match world-1 (")
    assert "Warning" not in result.stderr and "warnings.warn" not in result.stderr, result.stderr[-2000:]
    document = json.loads(report_path.read_text())
    assert [t["model"] for t in document["topologies"]] == ["dense", "dense"]
    assert all(0 < t["wall_s"] < document["wall_s"] for t in document["topologies"]), document["wall_s"]
    for topology in document["topologies"]:  # every step's grads were judged, the worst one reported
        assert topology["phases"]["grads"]["worst_tensor"].startswith("step"), topology["phases"]["grads"]


def warning_rank(rank: int, world_size: int) -> int:
    import logging
    import warnings

    warnings.warn("megatron-style start-up noise")
    logging.getLogger("megatron.core.models.gpt.gpt_model").warning("GPTModel-style deprecation notice")
    logging.getLogger("megatron_lora_patch").warning("our own warning")
    return rank


def test_rank_warnings_are_filtered_unless_asked_for(capfd):
    from megatron_lora_patch.proof.testbed.launcher import run_world

    assert run_world(warning_rank, 1, warnings="ignore") == [0]
    quiet = capfd.readouterr().err
    assert "start-up noise" not in quiet and "deprecation notice" not in quiet
    assert "our own warning" in quiet  # the plugin's own warnings are never filtered
    assert run_world(warning_rank, 1, warnings="default") == [0]
    loud = capfd.readouterr().err
    assert "UserWarning: megatron-style start-up noise" in loud and "GPTModel-style deprecation notice" in loud


def cuda_notice_rank(rank: int, world_size: int) -> int:
    """What torch logs when Megatron imports torch.utils.cpp_extension on a CPU machine with a CUDA_HOME."""
    import logging

    import torch.utils.cpp_extension  # noqa: F401

    logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME='/usr/local'")
    return rank


def test_no_cuda_runtime_notice_is_filtered_in_every_rank_unless_asked_for(capfd):
    """Importing torch resets the "torch" logger's level: the rank filters its notices after that import."""
    from megatron_lora_patch.proof.testbed.launcher import run_world

    assert run_world(cuda_notice_rank, 2, warnings="ignore") == [0, 1]
    assert "No CUDA runtime is found" not in capfd.readouterr().err
    assert run_world(cuda_notice_rank, 1, warnings="default") == [0]
    assert "No CUDA runtime is found" in capfd.readouterr().err
