"""The oracle on packed (THD) data (`--data packed`, proof/testbed/packing.py): every default topology
trains LoRA like world 1 on rows of three sequences of unequal lengths with per-sequence masks, the
loss normalized by the global valid-token count. That the packed data reaches the model (attention
per sequence, CP split per sequence, global normalization, every CP rank's mask) is proven by the
`packed_*` mutations being caught (tests/test_oracle_mutations.py)."""

from __future__ import annotations

import pytest

from megatron_lora_patch.cli.oracle import DEFAULT_TOPOLOGIES, PACKED_TOPOLOGIES
from megatron_lora_patch.proof.oracle import harness
from megatron_lora_patch.proof.testbed.topology import Topology

PACKED = harness.OracleSettings(data="packed")


def _assert_passes(report, topologies) -> None:
    print(report.table())
    assert report.reference_error is None, report.reference_error
    assert [row.topology for row in report.topologies] == list(topologies)
    for row in report.topologies:
        assert row.error is None, f"{row.topology}: {row.error}"
        assert row.passed, {phase: metrics.rel_l2 for phase, metrics in row.phases.items()}
        assert set(row.phases) == {"forward", "loss", "grads", "grad_norm", "deltas"}


def test_packed_model_is_fed_packed_rows():
    spec = harness.check_topology(Topology.parse("cp2"), PACKED)
    assert spec.packed and not harness.check_topology(Topology.parse("cp2"), harness.OracleSettings()).packed
    assert "cp4" not in ",".join(PACKED_TOPOLOGIES) and "tp2-cp2" in PACKED_TOPOLOGIES


def test_masked_names_the_default_unpacked_rows_of_sft_masks():
    """`--data masked` (unpacked SFT rows) is the default data: prompt prefixes and holes masked, counts unequal."""
    import argparse

    from megatron_lora_patch.cli import oracle as command
    from megatron_lora_patch.proof.testbed.data import make_global_batch

    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    arguments = [parser.parse_args(["oracle", "--data", data]) for data in ("masked", "unpacked")]
    settings = [command.check_arguments(parsed)[2] for parsed in arguments]
    assert settings[0] == settings[1] == harness.OracleSettings() and settings[0].data == "unpacked"
    counts = make_global_batch(1, 8, 16, 128)["loss_mask"].sum(dim=1)
    assert 0 < counts.min() < counts.max() < 16


def test_default_topologies_match_world1_on_packed_data():
    _assert_passes(harness.run_oracle(DEFAULT_TOPOLOGIES, settings=PACKED), DEFAULT_TOPOLOGIES)


@pytest.mark.slow
def test_cp_with_tp_and_dp_matches_world1_on_packed_data():
    topologies = ("tp2-cp2", "cp2-dp2")
    _assert_passes(harness.run_oracle(topologies, settings=PACKED), topologies)
