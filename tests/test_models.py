"""Tiny models: logical weights independent of topology; TP2+SP and EP2 forward equal world size 1."""

from __future__ import annotations

import pytest
import torch
from error_metrics import relative_l2_error

from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec, logical_shapes, logical_state_dict
from megatron_lora_patch.proof.testbed.shards import Shard, assemble_logical

DENSE = TinyGPTSpec()
MOE_ALLGATHER = TinyGPTSpec.moe("allgather")
MOE_ALLTOALL = TinyGPTSpec.moe("alltoall")
ONLY_CPU_COMPAT = {"cpu_compat": True, "lora_linear": False, "finalize_grads": False, "loss_normalization": False}


def _batch(spec: TinyGPTSpec):
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, spec.vocab_size, (2, spec.seq_length), generator=generator)
    positions = torch.arange(spec.seq_length).unsqueeze(0).expand(2, -1)
    return tokens, positions


def _gather_vocab(logits):
    """Full-vocab logits from the vocab-parallel [b, s, V/tp] output."""
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(size)]
    torch.distributed.all_gather(parts, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def forward_logits(rank, world_size, topology_spec, specs):
    """On each rank: build each spec's model on `topology_spec` and return its gathered logits."""
    import megatron_lora_patch
    from megatron_lora_patch.proof.testbed import models
    from megatron_lora_patch.proof.testbed.topology import Topology

    megatron_lora_patch.apply(plugins=["lora_correct", "cpu_testbed"], enable=ONLY_CPU_COMPAT)
    topology = Topology.parse(topology_spec)
    results = []
    with topology.world(cpu_compat=False):
        for spec in specs:
            model = models.build_model(spec, topology)[0]
            with torch.no_grad():
                results.append(_gather_vocab(model(*_batch(spec), None)))
    return results


def world1_checks(rank, world_size):
    """World size 1: parameter names/shapes are `logical_shapes`; two builds give identical losses."""
    import megatron_lora_patch
    from megatron_lora_patch.proof.testbed import models
    from megatron_lora_patch.proof.testbed.topology import Topology

    megatron_lora_patch.apply(plugins=["lora_correct", "cpu_testbed"], enable=ONLY_CPU_COMPAT)
    report = {}
    with Topology().world(cpu_compat=False):
        for spec in (DENSE, DENSE.replace(tie_embeddings=True), MOE_ALLGATHER):
            losses = []
            for _ in range(2):
                model = models.build_model(spec, seed=11)[0]
                tokens, positions = _batch(spec)
                with torch.no_grad():
                    losses.append(model(tokens, positions, None, labels=tokens.roll(-1, 1)).mean())
            shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
            report[str(spec)] = (shapes, losses)
    return report


def test_logical_state_dict_depends_only_on_seed_and_name():
    first, again = logical_state_dict(DENSE, 3), logical_state_dict(DENSE, 3)
    deeper = logical_state_dict(DENSE.replace(num_layers=4), 3)
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert all(torch.equal(first[name], deeper[name]) for name in first)  # same name, same values
    assert not torch.equal(first["output_layer.weight"], logical_state_dict(DENSE, 4)["output_layer.weight"])
    assert {name: tuple(t.shape) for name, t in first.items()} == logical_shapes(DENSE)


def test_shard_take_place_round_trip_including_swiglu_halves():
    full = torch.arange(32.0).reshape(8, 4)
    gated = Shard("fc1", partition_dim=0, rank=1, size=2, gated=True)
    assert gated.take(full).tolist() == full[[2, 3, 6, 7]].tolist()  # [gate_shard; up_shard]
    shards = [Shard("w", 1, rank, 2) for rank in range(2)] + [Shard("fc1", 0, rank, 2, True) for rank in range(2)]
    items = [[(shard, shard.take(full))] for shard in shards]
    rebuilt = assemble_logical(items, {"w": (8, 4), "fc1": (8, 4)})
    assert torch.equal(rebuilt["w"], full) and torch.equal(rebuilt["fc1"], full)
    with pytest.raises(ValueError, match="no rank provided"):
        assemble_logical(items[:1], {"w": (8, 4)})


def test_world1_parameters_are_the_logical_ones_and_forward_is_deterministic():
    report = run_world(world1_checks, 1, name="tp1")[0]
    for spec in (DENSE, DENSE.replace(tie_embeddings=True), MOE_ALLGATHER):
        shapes, losses = report[str(spec)]
        assert shapes == logical_shapes(spec)
        assert torch.isfinite(losses[0]) and torch.equal(losses[0], losses[1])


@pytest.fixture(scope="module")
def world1_logits():
    specs = (DENSE, MOE_ALLGATHER, MOE_ALLTOALL)
    return dict(zip(specs, run_world(forward_logits, 1, args=("tp1", specs), name="tp1")[0]))


def test_tp2_sp_forward_equals_world1(world1_logits):
    for logits in run_world(forward_logits, 2, args=("tp2-sp", (DENSE,)), name="tp2-sp"):
        assert relative_l2_error(logits[0], world1_logits[DENSE]) < 1e-5


def test_ep2_forward_equals_world1_for_both_dispatchers(world1_logits):
    specs = (MOE_ALLGATHER, MOE_ALLTOALL)
    for rank_logits in run_world(forward_logits, 2, args=("ep2", specs), name="ep2"):
        for spec, logits in zip(specs, rank_logits):
            assert relative_l2_error(logits, world1_logits[spec]) < 1e-5, spec.moe_token_dispatcher_type


def test_etp2_forward_equals_world1_for_both_dispatchers(world1_logits):
    """Expert-TP 2 (dense TP 1): the alltoall dispatcher's uneven gathers run through gloo."""
    specs = (MOE_ALLGATHER, MOE_ALLTOALL)
    for rank_logits in run_world(forward_logits, 2, args=("etp2", specs), name="etp2"):
        for spec, logits in zip(specs, rank_logits):
            assert relative_l2_error(logits, world1_logits[spec]) < 1e-5, spec.moe_token_dispatcher_type
