"""`layout_invariant` on real gloo worlds: LoRA training is BITWISE identical across DP and PP
(with TP and SP) layouts, and the test can fail (docs/architecture.md section 7).

The oracle's dense GQA model, 2 real Megatron training steps (DDP, 1F1B schedule under PP,
finalize, Adam with clipping), global batch 16 of micro batch 1: each of the 8 lanes of the
reduction tree chains two microbatches, so both levels of the tree run. Every layout is
compared with world size 1 (pp2 and tp2-dp2-sp here; the other layouts in `oracle --layout-invariant`'s matrix,
tests/test_oracle.py), through the oracle's canonicalization, on forward outputs,
per-microbatch losses and the reported loss, adapter grads, grad norm and adapter deltas:
max |difference| must be exactly 0 in every phase.

The same with Megatron's distributed optimizer on dp2, tp2-dp2-sp and pp2-dp2.

Negative controls (each must show a non-zero difference somewhere):
- the default mode (no layout_invariant) on dp2 and pp2;
- the layout mode with a mutation that reduces in rank order (each rank chains its lanes in
  arrival order, then the partials are chained in DP rank order) on dp2 and dp4.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_lora_patch.patches.layout_invariant import SPEC
from megatron_lora_patch.proof.oracle import harness, phases
from megatron_lora_patch.proof.oracle.mutations import Mutation
from megatron_lora_patch.proof.testbed.runner import run_jobs
from megatron_lora_patch.proof.testbed.topology import Topology
from megatron_lora_patch.runtime import versions

_OUT_OF_RANGE = versions.out_of_range_reason(SPEC.name, SPEC.versions, versions.installed_megatron_core())
pytestmark = pytest.mark.skipif(bool(_OUT_OF_RANGE), reason=f"layout_invariant does not apply here: {_OUT_OF_RANGE}")

LAYOUT = harness.OracleSettings(layout_invariant=True, global_batch_size=16, steps=2)
DEFAULT = dataclasses.replace(LAYOUT, layout_invariant=False)
TIMEOUT_S = 600.0


# -- in the ranks: the mutation ----------------------------------------------------------------


def _chained(items):
    present = [item for item in items if item is not None]
    total = present[0].clone()
    for item in present[1:]:
        total += item
    return total


def _rank_order_reduce(self) -> None:
    """`BufferLanes.reduce_into_grad_buffer` reducing in rank order instead of the canonical tree."""
    partial = _chained([self.flat[lane] if lane in self.used else None for lane in self.lanes])
    pieces = [torch.empty_like(partial) for _ in range(self.dp_size)]
    torch.distributed.all_gather(pieces, partial, group=self.group)
    self.buffer.grad_data.copy_(_chained(pieces))


def _install_rank_order(patcher) -> None:
    from megatron_lora_patch.layout_invariant.lanes import BufferLanes

    patcher.replace(BufferLanes, "reduce_into_grad_buffer", _rank_order_reduce)


RANK_ORDER = Mutation("rank_order_reduction", "DP partials reduced in rank order, not the canonical tree", "dp2",
                      install=_install_rank_order)


# -- runs and comparison -----------------------------------------------------------------------


def _phases(settings, topology_text: str, shapes=None, mutation=None, distributed_optimizer=False):
    """(canonical phases, adapter shapes) of one run; the shapes are read off a world-1 run."""
    job = harness.make_job(Topology.parse(topology_text), settings, mutation)
    if distributed_optimizer:
        train = dataclasses.replace(job.settings, use_distributed_optimizer=True)
        job = dataclasses.replace(job, settings=train)
    (records,) = run_jobs([job], timeout=TIMEOUT_S, warnings="ignore")
    shapes = shapes if shapes is not None else phases.adapter_shapes(records)
    return phases.canonical_phases(records, job.spec, shapes), shapes


def max_differences(candidate: dict, reference: dict) -> dict:
    """{phase: max |candidate - reference|} over every tensor or scalar of the phase (float64)."""
    worst = {}
    for phase, expected in reference.items():
        assert set(candidate[phase]) == set(expected), phase
        worst[phase] = max(
            float((torch.as_tensor(candidate[phase][key], dtype=torch.float64)
                   - torch.as_tensor(expected[key], dtype=torch.float64)).abs().max())
            for key in expected
        )
    return worst


@pytest.fixture(scope="module")
def layout_reference():
    return _phases(LAYOUT, "tp1")


@pytest.fixture(scope="module")
def default_reference():
    return _phases(DEFAULT, "tp1")


# Two layouts here (PP's schedule; TP x SP x DP): every other default layout runs once, in the `-m slow` matrix of
# tests/test_oracle.py (`oracle --layout-invariant`, the same settings), which the CI runs: not twice.
@pytest.mark.parametrize("topology", ["pp2", "tp2-dp2-sp"])
def test_layout_is_bitwise_equal_to_world_one(layout_reference, topology):
    reference, shapes = layout_reference
    candidate, _ = _phases(LAYOUT, topology, shapes)
    differences = max_differences(candidate, reference)
    assert set(differences) == {"forward", "loss", "grads", "grad_norm", "deltas"}
    assert differences == dict.fromkeys(differences, 0.0)
    assert all(metrics.passed for metrics in phases.compare(candidate, reference, LAYOUT).values())


@pytest.mark.parametrize("topology", ["dp2", "tp2-dp2-sp", "pp2-dp2"])
def test_distributed_optimizer_is_bitwise_equal_to_world_one(layout_reference, topology):
    """Megatron's distributed optimizer (grads read off the full reduced buffer, Adam on DP shards)."""
    reference, shapes = layout_reference
    candidate, _ = _phases(LAYOUT, topology, shapes, distributed_optimizer=True)
    differences = max_differences(candidate, reference)
    assert differences == dict.fromkeys(differences, 0.0)


@pytest.mark.parametrize("topology", ["dp2", "pp2"])
def test_default_mode_is_not_bitwise(default_reference, topology):
    reference, shapes = default_reference
    candidate, _ = _phases(DEFAULT, topology, shapes)
    differences = max_differences(candidate, reference)
    assert max(differences.values()) > 0, differences


@pytest.mark.parametrize("topology", ["dp2", "dp4"])
def test_rank_order_reduction_is_caught(layout_reference, topology):
    reference, shapes = layout_reference
    candidate, _ = _phases(LAYOUT, topology, shapes, mutation=RANK_ORDER)
    differences = max_differences(candidate, reference)
    assert differences["grads"] > 0 and differences["deltas"] > 0, differences
    assert not all(metrics.passed for metrics in phases.compare(candidate, reference, LAYOUT).values())
