"""Logical init and layouts: topology-invariant factors, TP sharding, mixed QKV and SwiGLU fc1."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lora_patch.lora.adapters.init import logical_factors
from megatron_lora_patch.lora.adapters.layouts import (
    fc1_to_gate_up,
    gate_up_to_fc1,
    qkv_mixed_to_separate,
    qkv_separate_to_mixed,
    shard,
    unshard,
)
from megatron_lora_patch.lora.config import LoraConfig


def test_logical_factors_depend_only_on_seed_name_expert():
    config = LoraConfig(rank=4, b_init="nonzero", seed=3)
    a1, b1 = logical_factors(config, "decoder.layers.0.mlp.linear_fc1", None, 16, 32)
    a2, b2 = logical_factors(config, "decoder.layers.0.mlp.linear_fc1", None, 16, 32)
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    a3, _ = logical_factors(config, "decoder.layers.1.mlp.linear_fc1", None, 16, 32)
    a4, _ = logical_factors(config, "decoder.layers.0.mlp.linear_fc1", 1, 16, 32)
    a5, _ = logical_factors(LoraConfig(rank=4, seed=4), "decoder.layers.0.mlp.linear_fc1", None, 16, 32)
    assert not torch.equal(a1, a3) and not torch.equal(a1, a4) and not torch.equal(a1, a5)
    assert a1.abs().max() <= 1 / math.sqrt(16) and b1.abs().max() <= 1 / math.sqrt(4)
    assert a1.shape == (4, 16) and b1.shape == (32, 4)
    _, zero_b = logical_factors(LoraConfig(rank=4), "x", None, 16, 32)
    assert torch.count_nonzero(zero_b) == 0
    gaussian, _ = logical_factors(LoraConfig(rank=4, init="gaussian"), "x", None, 4096, 8)
    assert abs(gaussian.std().item() - 0.25) < 0.01


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_shards_reassemble_bitwise(world, stride):
    logical = torch.randn(16, 3)
    parts = [shard(logical, 0, rank, world, stride) for rank in range(world)]
    assert torch.equal(unshard(parts, 0, stride), logical)
    columns = [shard(logical.t(), 1, rank, world, stride) for rank in range(world)]
    assert torch.equal(unshard(columns, 1, stride), logical.t())


def test_swiglu_shard_holds_gate_and_up_shards():
    gate, up = torch.arange(8.0), 100 + torch.arange(8.0)
    fc1 = gate_up_to_fc1(gate, up)
    assert torch.equal(shard(fc1, 0, 1, 2, stride=2), torch.cat([gate[4:], up[4:]]))
    assert all(torch.equal(x, y) for x, y in zip(fc1_to_gate_up(fc1), (gate, up)))


@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 2), (8, 2), (4, 1)])
def test_qkv_round_trip_with_gqa(heads, groups):
    head_dim = 3
    q = torch.randn(heads * head_dim, 5)
    k = torch.randn(groups * head_dim, 5)
    v = torch.randn(groups * head_dim, 5)
    mixed = qkv_separate_to_mixed(q, k, v, groups, head_dim)
    # Megatron's packing: per query group [its q heads, k, v].
    per_group = (heads // groups + 2) * head_dim
    first = mixed[:per_group]
    assert torch.equal(first[: heads // groups * head_dim], q[: heads // groups * head_dim])
    assert torch.equal(first[heads // groups * head_dim : -head_dim], k[:head_dim])
    assert torch.equal(first[-head_dim:], v[:head_dim])
    assert all(torch.equal(x, y) for x, y in zip(qkv_mixed_to_separate(mixed, heads, groups, head_dim), (q, k, v)))
