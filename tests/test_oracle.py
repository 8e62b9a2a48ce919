"""The oracle's own invariants: the README command passes on the default matrix and writes
the documented JSON; a broken canonicalization, a crashed rank and a hung rank each fail clearly."""

import json
import re
import subprocess
import sys

import oracle_faults
import pytest
from test_oracle_lora_options import DENSE_ALL_BEYOND_DEFAULT

from megatron_lora_patch.cli.oracle import ALL_TOPOLOGIES, DEFAULT_TOPOLOGIES, LAYOUT_TOPOLOGIES
from megatron_lora_patch.proof.oracle import canonical, harness, phases
from megatron_lora_patch.proof.oracle.mutations import Mutation
from megatron_lora_patch.proof.oracle.report import OracleReport, TopologyResult
from megatron_lora_patch.proof.testbed.topology import Topology


def test_oracle_command_default_matrix(tmp_path):
    """`megatron-lora-patch oracle` (the README's main job): exit 0, table, verdict, JSON report."""
    report_path = tmp_path / "oracle.json"
    command = [sys.executable, "-m", "megatron_lora_patch", "oracle", "--json", str(report_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith("PASS: ")
    report = json.loads(report_path.read_text())
    assert report["passed"] is True
    assert [t["topology"] for t in report["topologies"]] == list(DEFAULT_TOPOLOGIES)
    for topology in report["topologies"]:
        assert topology["world_size"] == Topology.parse(topology["topology"]).world_size
        assert set(topology["phases"]) == {"forward", "loss", "grads", "grad_norm", "deltas"}
        for phase in topology["phases"].values():
            assert phase["passed"] and phase["rel_l2"] <= phase["threshold"]
            assert phase["per_layer"]


@pytest.mark.slow
def test_layout_invariant_command_default_matrix_is_bitwise(tmp_path):
    """`megatron-lora-patch oracle --layout-invariant` (docs/architecture.md section 7): every default layout,
    dense and MoE (tp / sp / dp / pp, ep / etp, MoE at tp2 and tp4), passes only at max |difference| == 0."""
    report_path = tmp_path / "layout.json"
    command = [sys.executable, "-m", "megatron_lora_patch", "oracle", "--layout-invariant", "--json", str(report_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    rows = report["topologies"]
    assert [row["topology"] for row in rows] == list(LAYOUT_TOPOLOGIES) and len(rows) >= 16
    assert {row["model"] for row in rows} == {"dense", "moe"}
    for row in rows:
        assert {name: phase["rel_l2"] for name, phase in row["phases"].items()} == dict.fromkeys(row["phases"], 0.0)


@pytest.mark.slow
def test_full_matrix_matches_world1():
    """`--topologies all` beyond the defaults (`test_oracle_command_default_matrix` runs those: not twice): here
    the expert topologies; the dense ones run once, with DoRA, whose A and B shard, sync and train as LoRA's and
    whose magnitude adds the row-parallel norm's TP sum (tests/test_oracle_lora_options.py): not twice either."""
    assert len(ALL_TOPOLOGIES) >= 20 and ALL_TOPOLOGIES[: len(DEFAULT_TOPOLOGIES)] == DEFAULT_TOPOLOGIES
    beyond = ALL_TOPOLOGIES[len(DEFAULT_TOPOLOGIES) :]
    experts = [spec for spec in beyond if Topology.parse(spec).ep > 1 or Topology.parse(spec).etp > 1]
    assert experts and set(beyond) - set(experts) == set(DENSE_ALL_BEYOND_DEFAULT)
    report = harness.run_oracle(experts)
    print(report.table())
    assert report.passed, report.table()


@pytest.fixture(scope="module")
def sp_records():
    """Rank records of one tp2-sp run and the world-1 reference (real runs, shared)."""
    settings = harness.OracleSettings()
    jobs = [harness.make_job(Topology.parse(spec), settings) for spec in ("tp1", "tp2-sp")]
    (reference, error_1), (candidate, error_2) = harness._run_isolated(jobs, timeout=600)
    assert error_1 is None and error_2 is None
    return jobs[0].spec, reference, candidate


def _forward_metrics(spec, reference, candidate):
    shapes = phases.adapter_shapes(reference)
    expected = phases.canonical_phases(reference, spec, shapes)
    actual = phases.canonical_phases(candidate, spec, shapes)
    return phases.compare(actual, expected, harness.OracleSettings())


def test_correct_canonicalization_passes(sp_records):
    metrics = _forward_metrics(*sp_records)
    assert all(m.passed for m in metrics.values()), {p: m.rel_l2 for p, m in metrics.items()}


def test_wrong_sequence_parallel_gather_order_fails(sp_records, monkeypatch):
    """Placing TP rank r's sequence shard where rank 1-r's belongs must fail the forward phase."""
    original = canonical._placement

    def swapped(tensor, module, layout, coords):
        flipped = dict(coords, tp_rank=coords["tp_size"] - 1 - coords["tp_rank"])
        return original(tensor, module, layout, flipped if module["mode"] == "row" else coords)

    monkeypatch.setattr(canonical, "_placement", swapped)
    metrics = _forward_metrics(*sp_records)
    assert not metrics["forward"].passed and metrics["forward"].rel_l2 > 1e-2


def test_wrong_column_shard_order_fails(sp_records, monkeypatch):
    """Treating the gated fc1 output as one contiguous TP cut (not [gate_shard; up_shard]) must fail."""
    original = canonical._placement

    def ungated(tensor, module, layout, coords):
        return original(tensor, dict(module, gated=False), layout, coords)

    monkeypatch.setattr(canonical, "_placement", ungated)
    metrics = _forward_metrics(*sp_records)
    assert not metrics["forward"].passed
    assert "linear_fc1" in metrics["forward"].worst_tensor


def test_crashed_and_hung_ranks_are_failures_not_hangs():
    crash = Mutation("crash", "a rank raises", "dp2", install=oracle_faults.crash_on_rank_1)
    hang = Mutation("hang", "a rank never returns", "dp2", install=oracle_faults.hang_on_rank_1)
    report = harness.run_oracle([], [crash, hang], harness.OracleSettings(steps=1, timeout_s=30))
    crashed, hung = report.mutations
    # Rank 0 may fail too once its peer is gone; the injected traceback must be there.
    assert re.match(r"world 'dp2': ranks? (0, )?1 failed", crashed.error), crashed.error[:200]
    assert "injected failure on rank 1" in crashed.error
    assert "timed out" in hung.error and "rank 1" in hung.error
    # A mutation that breaks the run is ERRORED, never "caught": a renamed Megatron attribute
    # must not turn --mutations all into "all caught".
    assert crashed.errored and hung.errored and not crashed.caught and not hung.caught
    assert [row.split()[-1] for row in report.table().splitlines() if row.startswith(("crash ", "hang "))] == [
        "ERRORED"
    ] * 2
    assert not report.passed
    assert report.verdict().startswith("FAIL: 0/0 topologies match world-1, 0/2 mutations caught (")
    assert report.verdict().endswith("; ERRORED (the run broke): crash, hang")
    assert report.as_dict()["mutations"][0]["outcome"] == "errored"
    # The same error on a topology run is a FAIL row carrying the traceback.
    row = TopologyResult("dp2", 2, {}, error=crashed.error)
    failing = OracleReport(settings={}, topologies=[row])
    assert not failing.passed and failing.verdict().startswith("FAIL: 0/1 topologies match world-1")
    assert "injected failure on rank 1" in failing.table()


def test_layout_invariant_oracle_is_bitwise_and_refuses_what_it_cannot_do():
    settings = harness.OracleSettings(layout_invariant=True)
    for run in (settings, harness.OracleSettings(layout_invariant=True, dtype="bf16", steps=3)):
        report = harness.run_oracle(["tp2-sp"], [], run)
        (row,) = report.topologies
        assert report.passed and {p: m.rel_l2 for p, m in row.phases.items()} == dict.fromkeys(row.phases, 0.0), run
        assert {p: m.max_abs for p, m in row.phases.items()} == dict.fromkeys(row.phases, 0.0), run
    for spec, message in (
        ("cp2", "--layout-invariant covers tp, sp, dp, pp, ep and etp; cp2 also uses cp"),
        ("ep2-etp4", "--layout-invariant cannot run ep2-etp4: expert tensor parallelism etp=4 is not proven"),
        ("dp3", "--layout-invariant needs a dp dividing 8"),
    ):
        with pytest.raises(harness.OracleError, match=re.escape(message)):
            harness.check_topology(Topology.parse(spec), settings)
    with pytest.raises(harness.OracleError, match="--layout-invariant runs without mutations"):
        harness.run_oracle(["tp2"], [Mutation("m", "bug", "tp2")], settings)


def test_moe_routing_equals_world1_and_a_flip_is_named():
    """Every router decision of every step is captured in world-1 layout and compared exactly."""
    settings = harness.OracleSettings()
    jobs = [harness.make_job(Topology.parse(spec), settings) for spec in ("tp1", "ep2")]
    jobs[0] = harness.make_job(Topology.parse("tp1"), harness.settings_for(jobs[1].spec, settings))
    (reference, error_1), (candidate, error_2) = harness._run_isolated(jobs, timeout=600)
    assert error_1 is None and error_2 is None
    expected, actual = phases.routing_maps(reference), phases.routing_maps(candidate)
    spec = jobs[1].spec
    microbatches = 8  # TrainSettings.global_batch_size / micro_batch_size
    assert len(expected) == settings.steps * spec.num_layers * microbatches
    assert all(t.shape == (spec.seq_length, 1, spec.num_experts) for t in expected.values())
    assert canonical.routing_divergence(actual, expected) == ""
    key = sorted(actual)[0]
    flipped = dict(actual, **{key: actual[key].clone()})
    flipped[key][3, 0] = 1.0 - flipped[key][3, 0]
    assert canonical.routing_divergence(flipped, expected) == (
        f"MoE routing diverged from world-1, so no comparison is meaningful: {key} (1 tokens)"
    )


def test_hybrid_model_matches_world1_on_the_dense_topologies_and_mutations_are_caught():
    """A HybridModel of attention and MLP layers (0.18+) on every default topology without experts; the
    negative controls: a column A's TP SUM skipped and gate/up swapped must fail by >= 100x."""
    settings = harness.OracleSettings(model="hybrid")
    dense = [name for name in DEFAULT_TOPOLOGIES if Topology.parse(name).ep == Topology.parse(name).etp == 1]
    mutations = harness.mutations_named(["skip_tp_sum_column_a", "swiglu_gate_up_mismatch"])
    report = harness.run_oracle(dense, mutations, settings)
    print(report.table())
    assert report.passed, report.table()
    assert {result.model for result in report.topologies} == {"hybrid"} and len(report.topologies) == len(dense) >= 5
    for mutation in report.mutations:
        assert mutation.caught and mutation.worst_ratio >= 100, report.table()
