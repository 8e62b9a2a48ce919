"""`oracle --model deepseek`: LoRA on MLA plus DeepSeek-V3's MoE routing (sigmoid scores, the aux-loss-free expert
bias, group-limited top-k, a routed scaling factor, a shared expert, a leading dense layer) matches world size 1,
the expert bias included (it is compared with the deltas after every step). The mutation
`expert_bias_from_local_counts` runs with the others in tests/test_oracle_mutations.py; dp2, pp2, cp2, tp2-etp2-sp
and tp2-ep2-etp2-sp pass too (`megatron-lora-patch oracle --model deepseek --topologies ...`, run by hand: CI time).
"""

from __future__ import annotations

import torch

from megatron_lora_patch.proof.oracle import canonical, harness
from megatron_lora_patch.proof.testbed.runner import run_jobs
from megatron_lora_patch.proof.testbed.topology import Topology


def test_deepseek_matches_world1():
    """ep2 splits the routed experts and the batch the bias counts come from; tp2-sp shards the shared expert,
    MLA and the router's sequence."""
    report = harness.run_oracle(["ep2", "tp2-sp"], (), harness.OracleSettings(model="deepseek"))
    print(report.table())
    assert [result.model for result in report.topologies] == ["deepseek", "deepseek"]
    assert all(result.passed for result in report.topologies), report.table()


def test_expert_bias_moves_every_step():
    """The bias the oracle compares is no constant: Megatron's finalize (under the plugin's grad sync) moves it by
    the update rate after every step, so a layout that never updated it would not match world-1."""
    settings = harness.OracleSettings(model="deepseek")
    (records,) = run_jobs([harness.make_job(Topology.parse(harness.REFERENCE), settings)])
    biases = canonical.agreed_expert_biases(records)
    rate = 1e-3  # Megatron-Core's default moe_router_bias_update_rate
    routers = {key.split("/", 1)[1] for key in biases}
    assert routers == {"decoder.layers.1.mlp.router.expert_bias"}  # layer 0 is the leading dense layer
    for router in routers:
        first, second = biases[f"step0/{router}"], biases[f"step1/{router}"]
        assert torch.allclose(first.abs(), torch.full_like(first, rate)), first
        assert torch.allclose((second - first).abs(), torch.full_like(first, rate)), second - first
