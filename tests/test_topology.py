"""Topology: spec grammar, canonical strings, validation messages, and real parallel_state setup on 2 gloo ranks."""

from __future__ import annotations

import pytest

from megatron_lora_patch.proof.testbed.launcher import gloo_process_group, run_world
from megatron_lora_patch.proof.testbed.patches import all_patch_names
from megatron_lora_patch.proof.testbed.topology import Topology, TopologyError

USAGE = (
    "expected dash-separated parts (tpN, ppN, cpN, dpN, epN, etpN, sp), "
    "e.g. 'tp2-sp', 'dp2', 'pp2', 'ep2', 'tp2-ep2-etp2-sp', 'tp2-dp2', 'cp2', 'tp1'"
)


@pytest.mark.parametrize(
    "spec, sizes, world_size, expert_dp",
    [
        ("tp1", dict(), 1, 1),
        ("tp2-sp", dict(tp=2, sp=True), 2, 2),
        ("dp2", dict(dp=2), 2, 2),
        ("pp2", dict(pp=2), 2, 1),
        ("cp2", dict(cp=2), 2, 2),
        ("ep2", dict(dp=2, ep=2), 2, 1),  # dp derived: EP is carved out of DP
        ("etp2", dict(dp=2, etp=2), 2, 1),
        ("tp2-ep2", dict(tp=2, ep=2), 2, 1),
        ("tp2-ep2-etp2-sp", dict(tp=2, dp=2, ep=2, etp=2, sp=True), 4, 1),
        ("tp2-dp2", dict(tp=2, dp=2), 4, 4),
        ("tp2-pp2-sp", dict(tp=2, pp=2, sp=True), 4, 2),
        ("tp2-pp2-cp2-ep4-etp2-sp", dict(tp=2, pp=2, cp=2, dp=2, ep=4, etp=2, sp=True), 16, 1),
        ("tp2-pp2-cp2-dp4-ep4-etp2-sp", dict(tp=2, pp=2, cp=2, dp=4, ep=4, etp=2, sp=True), 32, 2),
    ],
)
def test_canonical_specs_round_trip(spec, sizes, world_size, expert_dp):
    topology = Topology.parse(spec)
    assert topology == Topology(**sizes)
    assert str(topology) == spec
    assert Topology.parse(str(topology)) == topology
    assert topology.world_size == world_size
    assert topology.expert_dp == expert_dp
    assert topology.expert_dp * topology.ep * topology.etp * topology.pp == topology.world_size


@pytest.mark.parametrize(
    "spec, canonical",
    [
        ("sp-tp2", "tp2-sp"),  # any order
        ("tp1-pp1", "tp1"),  # explicit sizes of 1
        ("dp2-ep2", "ep2"),  # dp equal to the derived one
        ("ep2-dp4", "dp4-ep2"),  # a larger dp stays
        ("tp02", "tp2"),
    ],
)
def test_equivalent_specs_print_canonically(spec, canonical):
    assert str(Topology.parse(spec)) == canonical


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", f"invalid topology spec '': it is empty; {USAGE}"),
        ("xp2", f"invalid topology spec 'xp2': unknown part 'xp2'; {USAGE}"),
        ("TP2", f"invalid topology spec 'TP2': unknown part 'TP2'; {USAGE}"),
        ("tp2 ", f"invalid topology spec 'tp2 ': unknown part 'tp2 '; {USAGE}"),
        ("tp2--sp", f"invalid topology spec 'tp2--sp': empty part (doubled, leading or trailing '-'); {USAGE}"),
        ("tp2-tp4", "invalid topology spec 'tp2-tp4': duplicate part 'tp'; give each part at most once"),
        ("sp-tp2-sp", "invalid topology spec 'sp-tp2-sp': duplicate part 'sp'; give each part at most once"),
        ("tp0", "invalid topology spec 'tp0': size in 'tp0' must be a positive integer, e.g. 'tp2'"),
        ("tp-1", "invalid topology spec 'tp-1': part 'tp' needs a size, e.g. 'tp2'"),
        (
            "sp2-tp2",
            "invalid topology spec 'sp2-tp2': sequence parallel is a flag without a size: write 'sp', not 'sp2'",
        ),
        (
            "sp",
            "invalid topology spec 'sp': sp (sequence parallel) needs tp > 1, got tp1; use e.g. 'tp2-sp' or drop 'sp'",
        ),
        (
            "dp1-ep2",
            "invalid topology spec 'dp1-ep2': ep2 x etp1 = 2 expert ranks must divide tp*cp*dp = 1 "
            "(ranks per pipeline stage); use dp2 (or a multiple), or omit dp to derive it",
        ),
        (
            "tp2-dp3-ep4",
            "invalid topology spec 'tp2-dp3-ep4': ep4 x etp1 = 4 expert ranks must divide tp*cp*dp = 6 "
            "(ranks per pipeline stage); use dp2 (or a multiple), or omit dp to derive it",
        ),
    ],
)
def test_invalid_specs_say_what_is_wrong(spec, message):
    with pytest.raises(TopologyError) as caught:
        Topology.parse(spec)
    assert str(caught.value) == message


def test_constructor_checks_like_the_parser():
    with pytest.raises(TopologyError, match=r"^invalid topology: tp must be a positive integer, got 0$"):
        Topology(tp=0)
    with pytest.raises(TopologyError, match=r"^invalid topology: pp must be a positive integer, got True$"):
        Topology(pp=True)
    with pytest.raises(TypeError, match="topology spec must be a string, got Topology"):
        Topology.parse(Topology())


@pytest.mark.parametrize(
    "spec, model, message",
    [
        (
            "tp4-dp4",
            dict(),
            "topology 'tp4-dp4' does not fit: needs 16 ranks but at most 8 are allowed; use smaller sizes",
        ),
        (
            "ep2",
            dict(num_experts=None),
            "topology 'ep2' does not fit: ep2 and etp1 shard experts but the model has none (num_experts=None); "
            "drop ep/etp or use a MoE model",
        ),
        (
            "tp2-etp2",
            dict(num_experts=0),
            "topology 'tp2-etp2' does not fit: ep1 and etp2 shard experts but the model has none (num_experts=0); "
            "drop ep/etp or use a MoE model",
        ),
        (
            "ep4",
            dict(num_experts=6),
            "topology 'ep4' does not fit: num_experts=6 is not divisible by ep4; use an ep dividing 6",
        ),
        (
            "tp2-ep2",
            dict(num_experts=4),
            "topology 'tp2-ep2' does not fit: MoE with ep > 1 and tp > 1 needs sequence parallel "
            "(Megatron requires it); add 'sp'",
        ),
        (
            "etp2",
            dict(num_experts=4),
            "topology 'etp2' does not fit: etp2 with ep1 needs etp == tp (Megatron DDP treats ep1 expert weights "
            "as dense); use 'tp2-etp2-sp' or ep > 1",
        ),
        (
            "pp2",
            dict(num_layers=3),
            "topology 'pp2' does not fit: num_layers=3 is not divisible by pp2; use a pp dividing 3",
        ),
        (
            "cp2",
            dict(seq_length=6),
            "topology 'cp2' does not fit: seq_length=6 is not divisible by 2*cp = 4 (load-balanced CP chunks)",
        ),
        (
            "tp4-sp",
            dict(seq_length=6, num_layers=3),
            "topology 'tp4-sp' does not fit: seq_length=6 is not divisible by tp4 (sequence parallel splits it)",
        ),
        (
            "pp4-dp4",
            dict(num_layers=6),
            "topology 'pp4-dp4' does not fit: needs 16 ranks but at most 8 are allowed; use smaller sizes; "
            "num_layers=6 is not divisible by pp4; use a pp dividing 6",
        ),
    ],
)
def test_validate_names_every_misfit(spec, model, message):
    with pytest.raises(TopologyError) as caught:
        Topology.parse(spec).validate(**model)
    assert str(caught.value) == message


def test_validate_accepts_fitting_models():
    moe = Topology.parse("tp2-ep2-etp2-sp")
    assert moe.validate(num_experts=4, num_layers=2, seq_length=8) is moe
    assert Topology.parse("cp2-tp2-sp").validate(seq_length=8, max_world=4)
    assert Topology.parse("tp4-dp4").validate(max_world=None)
    assert Topology.parse("tp1").validate(seq_length=7)


# ----------------------------------------------------------------------------- real parallel_state on 2 ranks


def _process_groups_if_megatron_has_them(topology: Topology) -> dict:
    """Sizes of the tp / dp groups in ``process_groups()``; on Megatron without the class, check its error instead."""
    from megatron.core import parallel_state as ps
    from megatron.core import process_groups_config

    if not hasattr(process_groups_config, "ProcessGroupCollection"):  # Megatron-Core 0.13
        with pytest.raises(
            RuntimeError, match="this Megatron-Core has no process_groups_config.ProcessGroupCollection"
        ):
            topology.process_groups()
        return {"tp": ps.get_tensor_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size()}
    groups = topology.process_groups()
    return {"tp": groups.tp.size(), "dp": groups.dp.size()}


def _parallel_state_rounds(rank: int, world_size: int, specs: list[str]) -> dict:
    """Open, inspect and tear down one world per spec in sequence (also proves teardown is complete)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    import megatron_lora_patch

    seen = {}
    for spec in specs:
        topology = Topology.parse(spec)
        with topology.world(seed=1234, timeout_s=60) as inside:
            assert inside is topology
            groups = _process_groups_if_megatron_has_them(topology)
            with tensor_parallel.get_cuda_rng_tracker().fork():  # the model-parallel RNG stream
                model_parallel_draw = torch.rand(3)
            seen[spec] = dict(
                tp=(ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(), groups.get("tp")),
                pp=(ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()),
                cp=(ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()),
                dp=(ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), groups.get("dp")),
                ep=(ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()),
                etp=(ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()),
                expert_dp=ps.get_expert_data_parallel_world_size(),
                default_draw=torch.rand(3),
                model_parallel_draw=model_parallel_draw,
            )
        assert not ps.model_parallel_is_initialized() and not dist.is_initialized(), f"{spec}: teardown left groups"
        assert tensor_parallel.get_cuda_rng_tracker().get_states() == {}, f"{spec}: teardown left RNG states"
    with pytest.raises(RuntimeError) as caught:
        Topology.parse("tp1").initialize()
    seen["uninitialized_error"] = str(caught.value)
    with gloo_process_group(timeout_s=60), pytest.raises(RuntimeError) as caught:
        Topology.parse("tp1").initialize()
    seen["world_size_error"] = str(caught.value)
    seen["patches"] = {row.patch: row.enabled for row in megatron_lora_patch.status()}
    return seen


def test_initialize_sets_up_parallel_state_on_two_ranks():
    specs = ["tp2-sp", "dp2", "ep2", "pp2"]
    ranks = run_world(_parallel_state_rounds, 2, args=(specs,), timeout=240, name="+".join(specs))

    for rank, seen in enumerate(ranks):
        tp2, dp2, ep2, pp2 = (seen[spec] for spec in specs)
        assert (tp2["tp"], tp2["dp"], tp2["pp"], tp2["ep"], tp2["etp"], tp2["expert_dp"]) == (
            (2, rank, 2),
            (1, 0, 1),
            (1, 0),
            (1, 0),
            (1, 0),
            2,
        )
        assert (dp2["tp"], dp2["dp"], dp2["pp"], dp2["cp"]) == ((1, 0, 1), (2, rank, 2), (1, 0), (1, 0))
        assert (ep2["dp"], ep2["ep"], ep2["etp"], ep2["expert_dp"]) == ((2, rank, 2), (2, rank), (1, 0), 1)
        assert (pp2["tp"], pp2["pp"], pp2["dp"]) == ((1, 0, 1), (2, rank), (1, 0, 1))
        assert seen["uninitialized_error"] == (
            "Topology(tp1).initialize(): torch.distributed is not initialized; use Topology.world()"
        )
        assert seen["world_size_error"] == (
            "topology 'tp1' needs 1 ranks but the world has 2; launch with world_size=1"
        )
        # cpu_compat is on (no CUDA here); the LoRA patches were never turned on by the testbed.
        names = all_patch_names()
        assert set(names) <= set(seen["patches"]), sorted(seen["patches"])
        assert {name: seen["patches"][name] for name in names} == {name: name == "cpu_compat" for name in names}

    rank0, rank1 = ranks
    # Megatron-LM seeding: the default stream is shared by tensor-parallel peers; the
    # model-parallel stream differs across TP ranks; pipeline stages get seed + 100 * pp_rank.
    assert rank0["tp2-sp"]["default_draw"].equal(rank1["tp2-sp"]["default_draw"])
    assert not rank0["tp2-sp"]["model_parallel_draw"].equal(rank1["tp2-sp"]["model_parallel_draw"])
    assert rank0["dp2"]["model_parallel_draw"].equal(rank1["dp2"]["model_parallel_draw"])
    assert rank0["tp2-sp"]["default_draw"].equal(rank0["dp2"]["default_draw"])  # same seed, fresh state per world
    assert not rank0["pp2"]["default_draw"].equal(rank1["pp2"]["default_draw"])
