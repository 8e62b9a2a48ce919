"""The MoE helpers of the layout-invariant mode (docs/architecture.md section 7), on plain tensors
and real TransformerConfigs: no world.

- token chunks: bounds cover a segment exactly, padding adds zero rows only, the chunk chain is a
  left-to-right sum;
- fixed chunks make an expert GEMM's rows independent of how many rows surround them: a row
  computed in its padded chunk equals the same row computed in a chunk of other rows (bits), while
  the weight grad of one source's rows is the same whatever other sources share the expert;
- the expert-lane combine takes each lane from the one rank holding it and runs the canonical tree:
  the world-1 bits for the dp4 ep2 split, which is not a subtree ({0, 1, 4, 5} / {2, 3, 6, 7}); a
  rank-order chain (the mutation) differs; a lane held twice is refused in one line;
- sequence blocks: whatever order a microbatch's blocks arrive in (sequence shards of several TP
  ranks, autograd's order), the flush chains them in block order, the world-1 bits; the arrival-order
  chain (the mutation) differs; a block arriving twice is a bug (traceback);
- MoE settings the mode does not cover are refused with one line naming the fix (the alltoall
  dispatcher is covered, others are not).
"""

from __future__ import annotations

import pytest
import torch

from megatron_lora_patch.layout_invariant import LayoutInvariantUnsupported, experts
from megatron_lora_patch.layout_invariant.expert_blocks import SEQUENCE_BLOCKS, PendingBlocks
from megatron_lora_patch.layout_invariant.expert_lanes import combine_lanes
from megatron_lora_patch.layout_invariant.tree import LANES, canonical_sum


def _lanes(shape=(3, 5), seed=0) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) * 10.0 ** (index % 6) for index in range(LANES)]


def test_chunk_bounds_cover_a_segment_exactly():
    assert experts.chunk_bounds(0, 4) == []
    assert experts.chunk_bounds(4, 4) == [(0, 4)]
    assert experts.chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]


def test_padding_adds_zero_rows_only():
    rows = torch.randn(3, 2)
    out = experts.padded(rows, 5)
    assert out.shape == (5, 2) and torch.equal(out[:3], rows) and not out[3:].any()
    assert experts.padded(rows, 3) is rows
    assert experts.padded(torch.ones(2), 4).tolist() == [1.0, 1.0, 0.0, 0.0]


def test_chain_is_a_left_to_right_sum_skipping_none():
    items = [torch.tensor([1.0]), None, torch.tensor([-1.0]), torch.tensor([1e-8])]
    assert experts.chained(items).item() == torch.tensor(1e-8).item()  # (1 - 1) + 1e-8; 1 + (-1 + 1e-8) is 0
    assert experts.chained([None, None]) is None
    first = torch.tensor([2.0])
    assert experts.chained([first, torch.tensor([1.0])]).item() == 3.0 and first.item() == 2.0


def _segment_grad(weight, tokens):
    """Weight grad of sum(chunks(tokens) @ W^T) in padded chunks of 4, chained."""
    grads = []
    for start, stop in experts.chunk_bounds(tokens.shape[0], 4):
        chunk = experts.padded(tokens[start:stop], 4)
        grads.append(torch.autograd.grad(chunk.mm(weight.t()).sum(), weight)[0])
    return experts.chained(grads)


def test_fixed_chunks_make_rows_and_segment_grads_independent_of_neighbours():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(7, 33, generator=generator, requires_grad=True)
    mine, other = torch.randn(6, 33, generator=generator), torch.randn(9, 33, generator=generator)
    alone = experts.padded(mine[4:], 4).mm(weight.t())[:2]
    beside = torch.cat([mine[4:], other[:2]]).mm(weight.t())[:2]
    assert torch.equal(alone, beside)
    assert torch.equal(_segment_grad(weight, mine), _segment_grad(weight, mine.clone()))
    mixed = _segment_grad(weight, torch.cat([other, mine]))
    assert not torch.equal(mixed, _segment_grad(weight, mine))  # the control: other tokens do change it


def _split(lanes, holders):
    """Per rank: the [LANES, ...] stack (zeros where not held) and the held flags."""
    empty = torch.zeros_like(lanes[0])
    pieces = [torch.stack([lanes[lane] if lane in held else empty for lane in range(LANES)]) for held in holders]
    flags = [torch.tensor([lane in held for lane in range(LANES)]) for held in holders]
    return pieces, flags, empty


def test_expert_lane_combine_is_the_world_one_tree():
    lanes = _lanes()
    world_one = canonical_sum(lanes)
    for holders in ([set(range(LANES))], [{0, 1, 4, 5}, {2, 3, 6, 7}], [{0, 4}, {1, 5}, {2, 6}, {3, 7}]):
        assert torch.equal(combine_lanes(*_split(lanes, holders)), world_one), holders
    pieces, flags, empty = _split(lanes, [{0, 1, 4, 5}, {2, 3, 6, 7}])
    rank_order = experts.chained([piece[lane] for piece, flag in zip(pieces, flags)
                                  for lane in range(LANES) if flag[lane]])
    assert not torch.equal(rank_order, world_one)


def test_missing_lanes_are_skipped_and_a_lane_held_twice_is_refused():
    lanes = _lanes()
    assert torch.equal(combine_lanes(*_split(lanes, [{1, 3}, set()])), lanes[1] + lanes[3])
    assert not combine_lanes(*_split(lanes, [set()])).any()
    with pytest.raises(LayoutInvariantUnsupported, match=r"^layout_invariant: expert lane 2 was filled on .*\[0, 1\]"):
        combine_lanes(*_split(lanes, [{2}, {2}]))


def _flushed(pending: PendingBlocks) -> dict:
    added = {}
    pending.flush(lambda param, grad, microbatch: added.setdefault((param, microbatch), grad))
    return added


def test_sequence_blocks_are_chained_in_block_order_whatever_their_arrival():
    blocks, param = _lanes(seed=3), object()
    assert len(blocks) == SEQUENCE_BLOCKS
    world_one = experts.chained(blocks)
    for arrival in ([0, 1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 7, 0, 1, 2, 3], [6, 7, 2, 3, 4, 5, 0, 1]):
        pending = PendingBlocks()
        for block in arrival:
            pending.add(param, 5, block, blocks[block])
        assert torch.equal(_flushed(pending)[(param, 5)], world_one), arrival
        assert _flushed(pending) == {}
    assert not torch.equal(experts.chained([blocks[block] for block in [6, 7, 2, 3, 4, 5, 0, 1]]), world_one)


def test_missing_blocks_are_skipped_and_microbatches_kept_apart():
    blocks, param, pending = _lanes(seed=4), object(), PendingBlocks()
    pending.add(param, 1, 6, blocks[6])
    pending.add(param, 1, 2, blocks[2])
    pending.add(param, 9, 2, blocks[3])
    added = _flushed(pending)
    assert torch.equal(added[(param, 1)], blocks[2] + blocks[6]) and torch.equal(added[(param, 9)], blocks[3])
    pending.add(param, 1, 2, blocks[2])
    with pytest.raises(RuntimeError, match="expert block 2 of microbatch 1 arrived twice"):
        pending.add(param, 1, 2, blocks[2])


def test_experts_without_tokens_keep_hidden_and_probs_in_the_graph():
    """A rank whose experts got no token must still run the dispatcher's backward collectives of both the
    hidden states and the probabilities (Megatron runs its experts on empty tensors); dropping the probs made
    tp2-ep2-sp hang (one rank skipped the probabilities' reduce-scatter)."""
    import types

    hidden, probs = torch.randn(3, 4, requires_grad=True), torch.rand(3, requires_grad=True)
    experts._HANDOVER.update(segments=[[((0, 0), 0)], [((1, 0), 0)]])
    instance = types.SimpleNamespace(local_experts=[None, None])
    output, bias = experts.sequential_forward(None, instance, (hidden[:0], torch.tensor([0, 0]), probs[:0]), {})
    assert output.shape == (0, 4) and bias is None
    output.sum().backward()
    assert hidden.grad is not None and probs.grad is not None
    assert not hidden.grad.any() and not probs.grad.any()


def _moe_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
                add_bias_linear=False)
    return TransformerConfig(**{**base, **overrides})


@pytest.mark.parametrize("overrides, fix", [
    ({"moe_router_topk": 3}, "use moe_router_topk <= 2"),
    ({"moe_aux_loss_coeff": 0.01, "moe_router_load_balancing_type": "aux_loss"}, "set moe_aux_loss_coeff=0"),
    ({"moe_z_loss_coeff": 0.001}, "set moe_z_loss_coeff=0"),
    ({"moe_expert_capacity_factor": 1.0}, "set moe_expert_capacity_factor=None"),
    ({"moe_shared_expert_intermediate_size": 32}, "drop them"),
    ({"add_bias_linear": True}, "set add_bias_linear=False"),
])
def test_moe_refusals_name_the_fix(monkeypatch, overrides, fix):
    from megatron.core import parallel_state

    from megatron_lora_patch.layout_invariant import checks

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_expert_tensor_parallel_world_size", lambda: 1)
    checks.check_moe(_moe_config())
    with pytest.raises(LayoutInvariantUnsupported, match="^layout_invariant: [^\n]*" + fix.replace("(", r"\(")
                       .replace(")", r"\)") + "$"):
        checks.check_moe(_moe_config(**overrides))


def test_other_dispatchers_are_refused(monkeypatch):
    from megatron.core import parallel_state

    from megatron_lora_patch.layout_invariant import checks

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_expert_tensor_parallel_world_size", lambda: 1)
    checks.check_moe(_moe_config(moe_token_dispatcher_type="alltoall"))
    config = _moe_config()
    config.moe_token_dispatcher_type = "flex"
    with pytest.raises(LayoutInvariantUnsupported, match="set moe_token_dispatcher_type='allgather' or 'alltoall'$"):
        checks.check_moe(config)


@pytest.mark.parametrize("sizes, fix", [((8, 8, 1), "tensor_model_parallel_size <= 4"),
                                        ((2, 1, 1), "expert_model_parallel_size a multiple of tp"),
                                        ((4, 1, 2), "expert_model_parallel_size a multiple of tp"),
                                        ((1, 4, 2), "expert_tensor_parallel_size to 1, 2 or tensor_model"),
                                        ((1, 2, 1), "expert_tensor_parallel_size=tensor_model_parallel_size")])
def test_moe_parallel_refusals_name_the_fix(monkeypatch, sizes, fix):
    """(tp, etp, ep) sizes the mode refuses (the proven ones pass: next test)."""
    from megatron.core import parallel_state

    from megatron_lora_patch.layout_invariant import checks

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: sizes[0])
    monkeypatch.setattr(parallel_state, "get_expert_tensor_parallel_world_size", lambda: sizes[1])
    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_world_size", lambda: sizes[2])
    with pytest.raises(LayoutInvariantUnsupported, match="^layout_invariant: [^\n]*" + fix):
        checks.check_moe(_moe_config())


@pytest.mark.parametrize("sizes", [(1, 2, 2), (2, 1, 2), (2, 2, 1), (2, 2, 2), (2, 1, 4), (4, 1, 4), (4, 2, 2),
                                   (4, 4, 1)])
def test_proven_expert_sizes_are_accepted(monkeypatch, sizes):
    from megatron.core import parallel_state

    from megatron_lora_patch.layout_invariant import checks

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: sizes[0])
    monkeypatch.setattr(parallel_state, "get_expert_tensor_parallel_world_size", lambda: sizes[1])
    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_world_size", lambda: sizes[2])
    checks.check_moe(_moe_config())


def test_shared_outer_factors_are_refused_whatever_the_patch_order(monkeypatch):
    """The DDP-time check refuses shared outer factors even when the adapters were attached before the mode."""
    from megatron.core import parallel_state

    from megatron_lora_patch.layout_invariant import checks
    from megatron_lora_patch.lora.config import LoraConfig, set_active

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_expert_tensor_parallel_world_size", lambda: 1)
    try:
        set_active(LoraConfig(rank=4))
        checks.check_moe(_moe_config())
        set_active(LoraConfig(rank=4, expert_shared_outer=True))
        with pytest.raises(LayoutInvariantUnsupported, match="^layout_invariant: [^\n]*unset "
                           "MEGATRON_LORA_EXPERT_SHARED_OUTER or turn the layout_invariant patch off$"):
            checks.check_moe(_moe_config())
    finally:
        set_active(None)
