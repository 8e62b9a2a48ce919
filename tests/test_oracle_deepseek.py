"""`oracle --model deepseek`: LoRA on MLA plus DeepSeek-V3's MoE routing (sigmoid scores, the aux-loss-free expert
bias, group-limited top-k, a routed scaling factor, a shared expert, a leading dense layer) matches world size 1,
the expert bias included (it is compared with the deltas after every step). With `moe_shared_expert_overlap`
at tp2-sp the shared expert's adapters count once. The mutation `expert_bias_from_local_counts` runs with the others
in tests/test_oracle_mutations.py; tp2-sp, dp2, pp2, cp2, tp2-etp2-sp and tp2-ep2-etp2-sp pass too
(`megatron-lora-patch oracle --model deepseek --topologies ...`, run by hand: CI time).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_lora_patch.proof.oracle import canonical, harness, phases
from megatron_lora_patch.proof.testbed.runner import run_jobs
from megatron_lora_patch.proof.testbed.topology import Topology


def test_deepseek_matches_world1():
    """ep2 splits the routed experts and the batch the bias counts come from (tp2-sp, which shards the shared
    expert, MLA and the router's sequence, runs below with the shared-expert overlap)."""
    report = harness.run_oracle(["ep2"], (), harness.OracleSettings(model="deepseek"))
    print(report.table())
    assert [result.model for result in report.topologies] == ["deepseek"]
    assert all(result.passed for result in report.topologies), report.table()


@pytest.fixture(scope="module")
def overlap_runs():
    """World 1 and tp2-sp with `moe_shared_expert_overlap` (alltoall dispatcher, which the overlap needs). Forward
    outputs are not captured: under the overlap the shared expert's fc2 output is the pre-reduction partial over
    the whole sequence (`explicit_expert_comm`), which the forward canonicalization does not place."""
    spec = harness.DEEPSEEK.replace(moe_token_dispatcher_type="alltoall")
    settings = harness.OracleSettings(model="deepseek")

    def job(topology: str, model_config: dict):
        base = harness.make_job(Topology.parse(topology), settings)
        capture = dataclasses.replace(base.settings.capture, forward=None)
        train = dataclasses.replace(base.settings, capture=capture, model_config=model_config)
        return dataclasses.replace(base, spec=spec, settings=train)

    reference, overlapped = run_jobs([job(harness.REFERENCE, {}), job("tp2-sp", {"moe_shared_expert_overlap": True})])
    return spec, settings, reference, overlapped


def test_expert_bias_moves_every_step(overlap_runs):
    """The bias the oracle compares is no constant: Megatron's finalize (under the plugin's grad sync) moves it by
    the update rate after every step, so a layout that never updated it would not match world-1."""
    _, _, reference, _ = overlap_runs
    biases = canonical.agreed_expert_biases(reference)
    rate = 1e-3  # Megatron-Core's default moe_router_bias_update_rate
    routers = {key.split("/", 1)[1] for key in biases}
    assert routers == {"decoder.layers.1.mlp.router.expert_bias"}  # layer 0 is the leading dense layer
    for router in routers:
        first, second = biases[f"step0/{router}"], biases[f"step1/{router}"]
        assert torch.allclose(first.abs(), torch.full_like(first, rate)), first
        assert torch.allclose((second - first).abs(), torch.full_like(first, rate)), second - first


def test_shared_expert_overlap_counts_the_adapter_once(overlap_runs):
    """Under the overlap the shared expert's linears skip their TP collectives and the adapters' terms ride the
    pre-reduction partials: at tp2-sp each term must still count once (losses, grads, norm, deltas as world-1)."""
    spec, settings, reference, overlapped = overlap_runs
    shapes = phases.adapter_shapes(reference)
    assert any(".shared_experts.linear_fc2.lora." in name for name in shapes)
    metrics = phases.compare(
        phases.canonical_phases(overlapped, spec, shapes), phases.canonical_phases(reference, spec, shapes), settings
    )
    assert set(metrics) == {"loss", "grads", "grad_norm", "deltas"}
    assert all(phase.passed for phase in metrics.values()), {name: phase.rel_l2 for name, phase in metrics.items()}
