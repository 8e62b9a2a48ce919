"""`layout_invariant` on MoE models in real gloo worlds: LoRA training (expert adapters included) is
BITWISE identical across EP (and DP / PP) layouts, and the test can fail (docs/architecture.md section 7).

The oracle's MoE model (2 layers, 4 SequentialMLP experts, top-2, allgather dispatcher), 2 Megatron
training steps, global batch 16 of micro batch 1, compared with world size 1 through the oracle's
canonicalization: max |difference| must be exactly 0 in every phase. The same with expert chunks of
4 tokens (several chunks per segment, so the chained chunk partials run), with the alltoall token
dispatcher (ep2, dp4-ep2, ep2-etp2, tp2-ep2-etp2-sp) and with the distributed optimizer; expert TP on
ep2-etp2, and at tp2 with sequence parallelism (tp2-etp2-sp at ep 1, tp2-ep2-etp2-sp).

Negative controls (each must show a non-zero difference):
- the default mode (no layout_invariant) on ep2;
- the layout mode with the expert lanes combined in rank order (each expert-DP rank chains its
  lanes, then the ranks are chained), on ep2 and dp4-ep2;
- the layout mode with every source's tokens credited to the expert rank's own microbatch (what
  DDP's per-rank accumulation does), on dp4-ep2;
- alltoall under expert TP (ep2-etp2): the sources read in group rank order instead of ETP-rank-major;
- MoE at tp2 (tp2-ep2-etp2-sp): each sequence shard's tokens as its own expert segment, not joined
  with the other shards of its microbatch;
- expert TP (ep2-etp2): every ETP rank handing the dispatcher the complete expert input grad (its
  reduce-scatter then doubles it), and the router-probability grad left to Megatron (per-ETP-rank
  partial sums over the FFN columns, added by the dispatcher).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_layout_invariant import _OUT_OF_RANGE, LAYOUT, _phases, max_differences

from megatron_lora_patch.proof.oracle import harness, phases
from megatron_lora_patch.proof.oracle.mutations import Mutation

pytestmark = pytest.mark.skipif(bool(_OUT_OF_RANGE), reason=f"layout_invariant does not apply here: {_OUT_OF_RANGE}")

MOE = dataclasses.replace(LAYOUT, model="moe")
DEFAULT_MOE = dataclasses.replace(MOE, layout_invariant=False)
ZERO = {"forward": 0.0, "loss": 0.0, "grads": 0.0, "grad_norm": 0.0, "deltas": 0.0}


# -- in the ranks: the variant and the mutations -----------------------------------------------


def _install_small_chunks(patcher) -> None:
    from megatron_lora_patch.layout_invariant import experts

    patcher.replace(experts, "CHUNK_TOKENS", 4)


def _rank_order_combine(pieces, flags, empty):
    """`expert_lanes.combine_lanes` chaining each rank's lanes, then the ranks, instead of the tree."""
    total = empty.clone()
    for piece, flag in zip(pieces, flags):
        for lane in range(len(flag)):
            if bool(flag[lane]):
                total += piece[lane]
    return total


def _install_rank_order(patcher) -> None:
    from megatron_lora_patch.layout_invariant import expert_lanes

    patcher.replace(expert_lanes, "combine_lanes", _rank_order_combine)


def _own_microbatch_only(group):
    from megatron.core import parallel_state

    own = parallel_state.get_data_parallel_rank()  # every member joined into this rank's microbatch
    return tuple((own, member) for member in range(torch.distributed.get_world_size(group)))


def _install_own_microbatch(patcher) -> None:
    from megatron_lora_patch.layout_invariant import experts

    patcher.replace(experts, "_source_ranks", _own_microbatch_only)


def _one_segment_per_shard(keyed, start):
    segments = []
    for (dp_rank, _), count in keyed:
        segments.append((dp_rank, [(start, start + count)]))
        start += count
    return segments


def _install_shard_segments(patcher) -> None:
    from megatron_lora_patch.layout_invariant import experts

    patcher.replace(experts, "microbatch_segments", _one_segment_per_shard)


def _group_order(etp, ep):
    return list(range(etp * ep))


def _install_group_order(patcher) -> None:
    from megatron_lora_patch.layout_invariant import experts

    patcher.replace(experts, "alltoall_source_order", _group_order)


def _whole_input_grad(tensor, group):
    return tensor


def _install_whole_input_grad(patcher) -> None:
    from megatron_lora_patch.layout_invariant.tensor_parallel import linear

    patcher.replace(linear, "share_grad", _whole_input_grad)


def _megatron_probs(expert, tokens, probs):
    return expert(tokens, probs)[0]


def _install_megatron_probs(patcher) -> None:
    from megatron_lora_patch.layout_invariant import experts

    patcher.replace(experts, "scaled_expert", _megatron_probs)


SMALL_CHUNKS = Mutation("small_expert_chunks", "not a bug: expert chunks of 4 tokens", "ep2", model="moe",
                        install=_install_small_chunks)
RANK_ORDER = Mutation("expert_rank_order", "expert lanes chained in rank order, not the canonical tree", "ep2",
                      model="moe", install=_install_rank_order)
OWN_MICROBATCH = Mutation("expert_own_microbatch", "every source's expert grad in the rank's own microbatch lane",
                          "dp4-ep2", model="moe", install=_install_own_microbatch)
SHARD_SEGMENTS = Mutation("expert_shard_segments", "one expert segment per sequence shard, not per microbatch",
                          "tp2-ep2-etp2-sp", model="moe", install=_install_shard_segments)
GROUP_ORDER = Mutation("alltoall_group_order", "alltoall sources read in group rank order, not ETP-rank-major",
                       "ep2-etp2", model="moe", install=_install_group_order)

WHOLE_INPUT_GRAD = Mutation("etp_whole_input_grad", "every ETP rank hands over the complete expert input grad",
                            "ep2-etp2", model="moe", install=_install_whole_input_grad)
MEGATRON_PROBS = Mutation("etp_megatron_probs", "the router-probability grad as per-ETP-rank partial sums (Megatron's)",
                          "ep2-etp2", model="moe", install=_install_megatron_probs)


# -- runs and comparison -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_reference():
    return _phases(MOE, "tp1")


# Two layouts here: the other MoE layouts run once, in the `-m slow` matrix of tests/test_oracle.py
# (`oracle --layout-invariant`, the same settings), which the CI runs: not twice.
@pytest.mark.parametrize("topology", ["ep2", "tp2-ep2-etp2-sp"])
def test_moe_layout_is_bitwise_equal_to_world_one(moe_reference, topology):
    reference, shapes = moe_reference
    candidate, _ = _phases(MOE, topology, shapes)
    assert max_differences(candidate, reference) == ZERO
    assert all(metrics.passed for metrics in phases.compare(candidate, reference, MOE).values())


def test_small_chunks_are_bitwise_equal_to_world_one():
    reference, shapes = _phases(MOE, "tp1", mutation=SMALL_CHUNKS)
    candidate, _ = _phases(MOE, "dp4-ep2", shapes, mutation=SMALL_CHUNKS)
    assert max_differences(candidate, reference) == ZERO


def _alltoall_phases(topology_text: str, shapes=None, mutation=None):
    """`_phases` with the MoE model on Megatron's alltoall token dispatcher."""
    from megatron_lora_patch.proof.testbed.runner import run_jobs
    from megatron_lora_patch.proof.testbed.topology import Topology

    job = harness.make_job(Topology.parse(topology_text), MOE, mutation)
    job = dataclasses.replace(job, spec=job.spec.replace(moe_token_dispatcher_type="alltoall"))
    (records,) = run_jobs([job], timeout=600.0, warnings="ignore")
    shapes = shapes if shapes is not None else phases.adapter_shapes(records)
    return phases.canonical_phases(records, job.spec, shapes), shapes


def test_alltoall_dispatcher_is_bitwise_equal_to_world_one():
    reference, shapes = _alltoall_phases("tp1")
    for topology in ("ep2", "dp4-ep2", "ep2-etp2", "tp2-ep2-etp2-sp"):
        candidate, _ = _alltoall_phases(topology, shapes)
        assert max_differences(candidate, reference) == ZERO, topology
    candidate, _ = _alltoall_phases("ep2-etp2", shapes, mutation=GROUP_ORDER)  # negative control
    differences = max_differences(candidate, reference)
    assert differences["loss"] > 0 and differences["grads"] > 0, differences


def test_distributed_optimizer_on_experts_is_bitwise(moe_reference):
    reference, shapes = moe_reference
    candidate, _ = _phases(MOE, "dp4-ep2", shapes, distributed_optimizer=True)
    assert max_differences(candidate, reference) == ZERO


@pytest.mark.parametrize("topology", ["ep2", "ep2-etp2"])
def test_default_mode_is_not_bitwise(topology):
    reference, shapes = _phases(DEFAULT_MOE, "tp1")
    candidate, _ = _phases(DEFAULT_MOE, topology, shapes)
    differences = max_differences(candidate, reference)
    assert max(differences.values()) > 0, differences


@pytest.mark.parametrize("mutation, topology", [(RANK_ORDER, "ep2"), (RANK_ORDER, "dp4-ep2"),
                                                (OWN_MICROBATCH, "dp4-ep2"), (WHOLE_INPUT_GRAD, "ep2-etp2"),
                                                (MEGATRON_PROBS, "ep2-etp2"), (SHARD_SEGMENTS, "tp2-ep2-etp2-sp")])
def test_expert_mutations_are_caught(moe_reference, mutation, topology):
    reference, shapes = moe_reference
    candidate, _ = _phases(MOE, topology, shapes, mutation=mutation)
    differences = max_differences(candidate, reference)
    assert differences["grads"] > 0 and differences["deltas"] > 0, differences
    assert not all(metrics.passed for metrics in phases.compare(candidate, reference, MOE).values())


@pytest.mark.parametrize("text, problem", [("tp2-sp", "a multiple of tp"), ("ep2-etp4", "etp=4 is not proven")])
def test_oracle_refuses_expert_layouts_the_mode_refuses(text, problem):
    from megatron_lora_patch.proof.testbed.topology import Topology

    with pytest.raises(harness.OracleError, match=f"^--layout-invariant cannot run {text}: .*{problem}"):
        harness.check_topology(Topology.parse(text), MOE)
