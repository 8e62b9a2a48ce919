"""The oracle's report on synthetic results: verdict, JSON fields, table and the PNG heat map."""

import json

from megatron_lora_patch.oracle.metrics import PhaseMetrics
from megatron_lora_patch.oracle.report import MutationResult, OracleReport, TopologyResult
from megatron_lora_patch.oracle.thresholds import PHASES, THRESHOLDS


def _phases(scale: float) -> dict:
    return {
        phase: PhaseMetrics(scale * limit / 10, scale, f"{phase}.worst", {"0": scale * limit / 20, "1": scale * limit / 10}, limit)
        for phase, limit in THRESHOLDS["fp32"].items()
    }


def _report() -> OracleReport:
    report = OracleReport(settings={"thresholds": THRESHOLDS["fp32"]}, wall_s=12.0)
    report.topologies = [TopologyResult("tp2", 2, _phases(1.0)), TopologyResult("dp2", 2, _phases(1.0))]
    report.mutations = [
        MutationResult("skip_tp_sum_column_a", "tp2", "a bug", _phases(1e4)),
        MutationResult("harmless", "dp2", "no bug", _phases(1.0)),
    ]
    return report


def test_verdict_table_and_json(tmp_path):
    report = _report()
    assert not report.passed
    assert report.verdict() == (
        "FAIL: 2/2 topologies match world-1, 1/2 mutations caught (12 s); NOT CAUGHT: harmless"
    )
    table = report.table()
    assert table.splitlines()[0].split()[:3] == ["topology", "ranks", "forward"]
    assert "skip_tp_sum_column_a  tp2" in table and "NOT CAUGHT" in table
    path = tmp_path / "report.json"
    report.write_json(str(path))
    document = json.loads(path.read_text())
    assert [t["topology"] for t in document["topologies"]] == ["tp2", "dp2"]
    assert set(document["topologies"][0]["phases"]) == set(PHASES)
    caught = document["mutations"][0]
    assert caught["caught"] and abs(caught["worst_metric_over_threshold"] - 1e3) < 1e-6


def test_plot_writes_a_png(tmp_path):
    from megatron_lora_patch.oracle import plot

    path = tmp_path / "oracle.png"
    plot.heat_map(_report(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000


def test_routing_divergence_fails_a_topology_and_catches_a_mutation():
    message = "MoE routing diverged from world-1, so no comparison is meaningful: decoder.layers.0.mlp.router@mb0 (2 tokens)"
    report = OracleReport(settings={"thresholds": THRESHOLDS["fp32"]})
    report.topologies = [TopologyResult("ep2", 2, _phases(1.0), routing=message)]
    report.mutations = [MutationResult("expert_bug", "ep2", "a bug", _phases(1.0), routing=message)]
    assert not report.topologies[0].passed and report.mutations[0].caught
    assert f"  ep2: {message}" in report.table()
    assert report.table().splitlines()[-3].endswith("caught (routing diverged)")
    assert report.as_dict()["topologies"][0]["routing_divergence"] == message
