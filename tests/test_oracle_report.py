"""The oracle's report on synthetic results: verdict, JSON fields, table and the PNG heat map."""

import json

from megatron_lora_patch.proof.oracle.metrics import PhaseMetrics
from megatron_lora_patch.proof.oracle.report import MutationResult, OracleReport, TopologyResult
from megatron_lora_patch.proof.oracle.thresholds import PHASES, describe, threshold

SETTINGS = {"thresholds": describe("fp32"), "dtype": "fp32", "steps": 2, "seed": 1234}


def _phases(scale: float) -> dict:
    limits = {phase: threshold("fp32", phase, 0) for phase in PHASES}
    return {
        phase: PhaseMetrics(
            scale * limit / 10, scale, f"{phase}.worst", {"0": scale * limit / 20, "1": scale * limit / 10}, limit
        )
        for phase, limit in limits.items()
    }


def _report() -> OracleReport:
    report = OracleReport(settings=SETTINGS, wall_s=12.0)
    report.topologies = [TopologyResult("tp2", 2, _phases(1.0)), TopologyResult("dp2", 2, _phases(1.0))]
    report.mutations = [
        MutationResult("skip_tp_sum_column_a", "tp2", "a bug", _phases(1e4)),
        MutationResult("harmless", "dp2", "no bug", _phases(1.0)),
    ]
    return report


def test_verdict_table_and_json(tmp_path):
    report = _report()
    assert not report.passed
    assert report.verdict() == ("FAIL: 2/2 topologies match world-1, 1/2 mutations caught (12 s); NOT CAUGHT: harmless")
    table = report.table()
    assert table.splitlines()[0].startswith("relative L2 error vs world-1, ||run - world1|| / ||world1||")
    assert table.splitlines()[1] == "dtype fp32, 2 steps, seed 1234"
    assert table.splitlines()[3].split()[:7] == [
        "topology",
        "ranks",
        "model",
        "forward",
        "(<=1e-05)",
        "loss",
        "(<=1e-05/1e-04)",
    ]
    assert "skip_tp_sum_column_a  tp2" in table and "NOT CAUGHT" in table
    path = tmp_path / "report.json"
    report.write_json(str(path))
    document = json.loads(path.read_text())
    assert [t["topology"] for t in document["topologies"]] == ["tp2", "dp2"]
    assert set(document["topologies"][0]["phases"]) == set(PHASES)
    caught = document["mutations"][0]
    assert caught["caught"] and abs(caught["worst_metric_over_threshold"] - 1e3) < 1e-6


def test_plot_writes_a_png(tmp_path):
    from megatron_lora_patch.proof.oracle import plot

    path = tmp_path / "oracle.png"
    plot.heat_map(_report(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000


def test_routing_divergence_fails_a_topology_and_catches_a_mutation():
    message = (
        "MoE routing diverged from world-1, so no comparison is meaningful: decoder.layers.0.mlp.router@mb0 (2 tokens)"
    )
    report = OracleReport(settings=SETTINGS)
    report.topologies = [TopologyResult("ep2", 2, _phases(1.0), routing=message)]
    report.mutations = [MutationResult("expert_bug", "ep2", "a bug", _phases(1.0), routing=message)]
    assert not report.topologies[0].passed and report.mutations[0].caught
    assert f"  ep2: {message}" in report.table()
    assert report.table().splitlines()[-3].endswith("caught (routing diverged)")
    assert report.as_dict()["topologies"][0]["routing_divergence"] == message


def test_errored_mutation_fails_the_run_and_shows_a_traceback_tail():
    traceback = "world 'tp2': rank 1 failed\n--- rank 1 traceback ---\n" + "\n".join(f"  frame {i}" for i in range(40))
    report = OracleReport(settings=SETTINGS, wall_s=3.0)
    report.mutations = [
        MutationResult("renamed_attribute", "tp2", "a bug", {}, error=traceback + "\nAttributeError: gone")
    ]
    (mutation,) = report.mutations
    assert mutation.errored and not mutation.caught and mutation.outcome == "errored" and not report.passed
    assert (
        report.verdict()
        == "FAIL: 0/0 topologies match world-1, 0/1 mutations caught (3 s); ERRORED (the run broke): renamed_attribute"
    )
    table = report.table()
    assert "AttributeError: gone" in table and "frame 39" in table and "frame 20" not in table
    assert len(table.splitlines()) < 30


def test_failed_reference_is_one_verdict_and_a_tail():
    error = "the world-1 reference run of the dense model failed:\nworld 'tp1': rank 0 failed\n" + "\n".join(
        f"line {i}" for i in range(400)
    )
    report = OracleReport(settings=SETTINGS, wall_s=9.0, reference_error=error)
    lines = report.table().splitlines()
    assert not report.passed and len(lines) < 20
    assert lines[-1] == "FAIL: the world-1 reference run of the dense model failed, so nothing was compared (9 s)"
    assert lines[0] == "  world 'tp1': rank 0 failed" and "line 399" in lines[-3]
