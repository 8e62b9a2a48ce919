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
- sequence shards: one microbatch's shards (its DP rank's TP ranks) are joined in TP rank order
  whatever order the dispatcher delivers them in, and the joined weight grad is world 1's bits; the
  shards chunked on their own (the mutation) differ; experts without tokens stay in the graph;
- MoE settings the mode does not cover are refused with one line naming the fix (the alltoall
  dispatcher is covered, others are not).
"""

from __future__ import annotations

import pytest
import torch

from megatron_lora_patch.layout_invariant import LayoutInvariantUnsupported, experts
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


def test_microbatch_segments_join_the_sequence_shards_of_one_microbatch_in_tp_order():
    # delivery order as the alltoall dispatcher under expert TP has it: (dp, tp) = (0, 1), (1, 1), (0, 0), (1, 0)
    keyed = [((0, 1), 3), ((1, 1), 2), ((0, 0), 4), ((1, 0), 0)]
    assert experts.microbatch_segments(keyed, 10) == [(0, [(15, 19), (10, 13)]), (1, [(19, 19), (13, 15)])]
    assert experts.microbatch_segments([((2, 0), 5)], 0) == [(2, [(0, 5)])]  # tp1: one source per microbatch


def test_joined_shards_give_the_world_one_weight_grad():
    """The weight grad of a microbatch's tokens joined from its two shards equals world 1's (one segment) bit
    for bit; the shards chunked on their own (the mutation the mode must not be) differ."""
    generator = torch.Generator().manual_seed(7)
    tokens, grads = torch.randn(40, 32, generator=generator), torch.randn(40, 16, generator=generator)

    def weight_grad(rows):  # chained chunk partials of grads^T tokens, chunks of 64 rows
        return experts.chained([experts.padded(grads[rows][start:stop], 64).t().mm(
            experts.padded(tokens[rows][start:stop], 64)) for start, stop in experts.chunk_bounds(len(rows), 64)])

    world_one = weight_grad(list(range(40)))
    (_, ranges), = experts.microbatch_segments([((0, 1), 17), ((0, 0), 23)], 0)
    joined = [row for start, stop in ranges for row in range(start, stop)]
    assert torch.equal(weight_grad([row - 17 if row >= 17 else row + 23 for row in joined]), world_one)
    assert not torch.equal(weight_grad(list(range(23))) + weight_grad(list(range(23, 40))), world_one)


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
    ({"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
     "the expert-bias update is not proven bit-exact yet; turn it off"),
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
