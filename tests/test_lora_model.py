"""GPT-level LoRA: adapters attached by the `lora_linear` patch on the tiny testbed models.

Each world runs once per module (fixtures) and reports findings (tests/lora_model_worker.py);
the tests compare them with world size 1 or with dense recomputes:
- QKV: q/k/v that Megatron's attention splits from `linear_qkv` equal a dense model with
  separate q/k/v weights and separate LoRA B slices (GQA), world 1 and TP2.
- Merge: logits equal a model whose logical weights absorbed `W + s B A` (all layouts).
- Init: the logical adapters assembled from TP2, EP2, PP2 (TP4 slow) shards are bitwise
  the world-size-1 ones, SwiGLU fc1 B (stride 2) and global expert indices included.
- Freezing: only adapters require grad, sit in Megatron DDP's buffers (experts in the
  expert-parallel ones), reach the optimizer and change in an optimizer step.
- Activation recompute (full, selective) leaves adapter grads unchanged (dropout on).
- Dropout: column masks equal on both TP ranks, row masks differ (with and without SP).
- Bad configuration: exact messages.
"""

from __future__ import annotations

from collections import defaultdict

import lora_model_worker as worker
import pytest
import torch
from error_metrics import assert_errors_within

from megatron_lora_patch.lora.adapters.layouts import unshard
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.topology import Topology

TOLERANCE = 1e-6  # max_abs_error_over_max in fp32
QKV_ERRORS = ("q", "k", "v", "mixed_q", "mixed_k", "mixed_v")  # separate q/k/v, then rows of the mixed layout


def _run(function, topology: str, *args):
    return run_world(function, Topology.parse(topology).world_size, args=(topology, *args), name=topology, timeout=300)


@pytest.fixture(scope="module")
def world1():
    return _run(worker.dense_world, "tp1")[0]


@pytest.fixture(scope="module")
def tp2():
    return _run(worker.dense_world, "tp2")


def logical_adapters(rank_results) -> dict:
    """name -> (A, B) assembled from every rank's shards; replicas must agree bitwise."""
    pieces = defaultdict(dict)
    for shards in rank_results:
        for entry in shards:
            assert entry["name"] == entry["testbed_name"], "adapter and testbed disagree on the canonical name"
            held = pieces[entry["name"]].setdefault(entry["tp_rank"], entry)
            assert torch.equal(held["A"], entry["A"]) and torch.equal(held["B"], entry["B"]), entry["name"]
    logical = {}
    for name, by_rank in pieces.items():
        shards = [by_rank[rank] for rank in sorted(by_rank)]
        assert len(shards) == shards[0]["tp_size"], f"{name}: shards of TP ranks {sorted(by_rank)} only"
        if shards[0]["mode"] == "column":  # A replicated: every rank's copy is the same logical A
            assert all(torch.equal(shard["A"], shards[0]["A"]) for shard in shards), name
            logical[name] = (shards[0]["A"], unshard([s["B"] for s in shards], 0, shards[0]["stride"]))
        else:
            assert all(torch.equal(shard["B"], shards[0]["B"]) for shard in shards), name
            logical[name] = (unshard([s["A"] for s in shards], 1), shards[0]["B"])
    return logical


def assert_bitwise_equal(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name, (lora_a, lora_b) in expected.items():
        assert torch.equal(actual[name][0], lora_a), f"{name}.A differs from world size 1"
        assert torch.equal(actual[name][1], lora_b), f"{name}.B differs from world size 1"


# -- QKV layout ------------------------------------------------------------------------------


@pytest.mark.parametrize("world", ["world1", "tp2"])
def test_qkv_lora_slices_land_on_query_key_value(world, request):
    results = request.getfixturevalue(world)
    for rank, found in enumerate(results if isinstance(results, list) else [results]):
        errors = found["qkv"]
        assert errors.pop("lora_share_of_q") > 0.1, "the LoRA delta is too small for this check to mean anything"
        assert_errors_within(errors, QKV_ERRORS, TOLERANCE, f"{world} rank {rank}")


@pytest.mark.parametrize("world", ["world1", "tp2"])
def test_lora_model_equals_merged_weights(world, request):
    results = request.getfixturevalue(world)
    for rank, found in enumerate(results if isinstance(results, list) else [results]):
        # fp32: merging reorders the sums (x (W + sBA)^T vs x W^T + s (x A^T) B^T)
        assert found["merged"] <= 1e-5, f"{world} rank {rank}: logits differ from the merged model by {found['merged']}"


# -- topology-invariant init -----------------------------------------------------------------


def test_init_tp2_shards_assemble_to_world1(world1, tp2):
    reference = logical_adapters([world1["adapters"]])
    assert any(name.endswith("linear_fc1") for name in reference)  # SwiGLU fc1: B sharded with stride 2
    assert_bitwise_equal(logical_adapters([found["adapters"] for found in tp2]), reference)


@pytest.mark.parametrize("topology", ["ep2", "pp2"])
def test_init_moe_shards_assemble_to_world1(world1, topology):
    reference = logical_adapters([world1["references"]["MOE"]])
    experts = {name for name in reference if ".local_experts." in name}
    assert {name.split(".local_experts.")[1].split(".")[0] for name in experts} == {"0", "1", "2", "3"}
    results = _run(worker.moe_world, topology)
    assert_bitwise_equal(logical_adapters([found["adapters"] for found in results]), reference)
    for found in results:  # experts live in DDP's expert-parallel buffers, dense adapters in the others
        freeze = found["freeze"]
        assert len(freeze["adapters"]) == 2 * len(found["adapters"]) > 0  # A and B of every adapter of this rank
        assert freeze["ddp_expert"] == freeze["expert_adapters"] and freeze["expert_adapters"]
        assert sorted(freeze["ddp_dense"] + freeze["ddp_expert"]) == freeze["adapters"] == freeze["optimizer"]
        if topology == "pp2":  # freeze_report's step is a plain forward/backward: it runs without PP only
            assert "changed" not in freeze
        else:
            assert freeze["changed"] == freeze["adapters"]  # the step moved every adapter and nothing else


@pytest.mark.slow
def test_init_tp4_shards_assemble_to_world1(world1):
    reference = logical_adapters([world1["references"]["DENSE_TP4"]])
    results = _run(worker.dense_world, "tp4", "DENSE_TP4")
    assert_bitwise_equal(logical_adapters([found["adapters"] for found in results]), reference)
    for rank, found in enumerate(results):
        errors = found["qkv"]
        assert errors.pop("lora_share_of_q") > 0.1
        assert_errors_within(errors, QKV_ERRORS, TOLERANCE, f"tp4 rank {rank}")


@pytest.mark.slow
def test_init_pp2_ep2_shards_assemble_to_world1(world1):
    reference = logical_adapters([world1["references"]["MOE"]])
    results = _run(worker.moe_world, "pp2-ep2")
    assert_bitwise_equal(logical_adapters([found["adapters"] for found in results]), reference)


# -- freezing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("world", ["world1", "tp2"])
def test_only_adapters_train(world, request):
    results = request.getfixturevalue(world)
    for found in results if isinstance(results, list) else [results]:
        freeze = found["freeze"]
        assert len(freeze["adapters"]) == 2 * 4 * worker.DENSE.num_layers  # A and B of 4 linears per layer
        assert freeze["requires_grad"] == freeze["adapters"]
        assert freeze["ddp_dense"] == freeze["adapters"] and freeze["ddp_expert"] == []
        assert freeze["optimizer"] == freeze["adapters"]
        assert freeze["changed"] == freeze["adapters"]  # the step moved every adapter and nothing else


# -- activation recompute ----------------------------------------------------------------------


@pytest.mark.parametrize("world", ["world1", "tp2"])
def test_recompute_keeps_adapter_grads(world, request):
    results = request.getfixturevalue(world)
    for rank, found in enumerate(results if isinstance(results, list) else [results]):
        errors = found["recompute"]
        adapter_factors = 2 * 4 * worker.DENSE.num_layers  # A and B of 4 linears per layer
        assert len(errors) == len(worker.RECOMPUTE) * adapter_factors, sorted(errors)
        assert {key.split(":")[0] for key in errors} == set(worker.RECOMPUTE)
        assert all(".lora." in key for key in errors), sorted(errors)
        bad = {key: value for key, value in errors.items() if not value <= TOLERANCE}
        assert not bad, f"{world} rank {rank}: adapter grads with recompute differ: {bad}"


# -- dropout masks -----------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["masks", "masks_sp"])
def test_dropout_masks_column_shared_row_per_rank(tp2, key):
    first, second = tp2[0][key], tp2[1][key]
    drawn = {name: mask for name, mask in first.items() if mask is not None}
    assert len(drawn) == 4 * worker.DENSE.num_layers, sorted(drawn)
    for name, mask in drawn.items():
        assert 0.3 < mask.float().mean().item() < 0.7, f"{name}: not a dropout-0.5 mask"
        if name.endswith("column_mask"):
            assert torch.equal(mask, second[name]), f"{key} {name}: TP ranks drew different column masks"
        else:
            assert not torch.equal(mask, second[name]), f"{key} {name}: TP ranks drew the same row mask"


# -- bad configuration -------------------------------------------------------------------------


def test_bad_config_messages(world1):
    assert world1["bad_config"] == {
        "no_match": "LoraConfig.targets entry 'linear_qvk' matches no linear layer of the model (did you mean "
        "'linear_qkv'?); linear layers: linear_proj, linear_qkv, linear_fc1, linear_fc2, output_layer (or fnmatch "
        "globs over qualified names such as 'decoder.layers.0.self_attention.linear_proj')",
        "rank_too_large": "LoRA rank 65 exceeds decoder.layers.0.self_attention.linear_proj (in 64, out 64); "
        "set LoraConfig.rank <= 64",
    }
