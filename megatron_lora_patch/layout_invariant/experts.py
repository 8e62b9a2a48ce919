"""MoE experts in the layout-invariant mode: fixed-size token chunks per global microbatch
(docs/architecture.md section 7).

Under expert parallelism an expert receives, in one microbatch step, the tokens of several global
microbatches (one per DP rank of its EP group), so the shapes of its GEMMs, and the microbatches
its weight grads mix, change with the layout. Here:

- the dispatcher wrappers hand the experts how many tokens each source rank sent to each local
  expert: `MoEAllGatherTokenDispatcher.dispatch_postprocess` by its `local_map` (`[tokens gathered
  over the TP x EP group, local experts]`, sources in group rank order), `MoEAlltoAllTokenDispatcher
  .dispatch_preprocess` by every source's routing-map column sums. Both dispatchers deliver an
  expert's tokens as one contiguous segment per source, sources in group rank order, each in that
  source's token order: exactly the tokens that expert gets from that source's microbatch (or, under
  sequence parallelism, its sequence shard) at world size 1;
- `SequentialMLP.forward` joins the shards of one microbatch (the sources of one DP rank, in TP rank,
  i.e. sequence, order: `microbatch_segments`) into one segment, so the segments do not depend on how
  tp shards the sequence, and runs each local expert on each segment in chunks of exactly
  `CHUNK_TOKENS` rows (the last one padded with zero rows, whose outputs are dropped and whose
  output grads are zero): every GEMM has the same shape on every layout, so each row and each
  chunk's weight-grad partial are the same bits; the router probabilities are applied on fc2's
  input with a canonical grad (`layout_invariant.expert_probs`, needed under expert TP);
- backward (`_ExpertSegment`) takes each chunk's grads with `torch.autograd.grad`, chains the
  chunks' weight grads in order and adds the sum into the lane of the segment's global microbatch
  `g = i * dp + source DP rank` (`i`: the local microbatch whose backward runs, the same on all EP
  ranks); the expert's parameters never get `.grad`, so DDP's own hook does not see them
  (`layout_invariant.expert_lanes` combines their lanes).

Combining a token's top-k expert outputs stays Megatron's: a scatter-add into zeros, then under EP
a reduce-scatter over the TP x EP group in which every other rank adds exact zeros; with top-k <= 2
that is `0 + a + b` in any order, the same bits (`checks` refuses larger k). Cost: padding (up to
`CHUNK_TOKENS - 1` rows per expert and microbatch), one autograd graph per chunk and, under sequence
parallelism, a copy of the expert's tokens and outputs (joining and splitting the shards).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed

from megatron_lora_patch.layout_invariant import LayoutInvariantUnsupported
from megatron_lora_patch.layout_invariant.expert_probs import scaled_expert

#: Rows of every expert GEMM: a segment of n tokens runs as ceil(n / CHUNK_TOKENS) chunks of this size.
CHUNK_TOKENS = 64

#: {"segments": per local expert, the `((source DP rank, source TP rank), token count)` of each segment in
#: delivery order}, set by the dispatcher wrapper and taken by the experts' forward that follows it.
_HANDOVER: Dict[str, Any] = {}
#: group -> the dense (DP rank, TP rank) of each member, in group rank order (one all-gather per group).
_SOURCE_RANKS: Dict[Any, Tuple[Tuple[int, int], ...]] = {}


def chunk_bounds(count: int, chunk: int) -> List[Tuple[int, int]]:
    """The `(start, stop)` rows of each chunk of a `count`-row segment; the last may be short (padded)."""
    return [(start, min(start + chunk, count)) for start in range(0, count, chunk)]


def padded(rows: torch.Tensor, chunk: int) -> torch.Tensor:
    """`rows` followed by zero rows up to `chunk` rows."""
    if rows.shape[0] == chunk:
        return rows
    return torch.cat([rows, rows.new_zeros((chunk - rows.shape[0],) + tuple(rows.shape[1:]))])


def chained(items: Sequence[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """`((items[0] + items[1]) + items[2]) + ...`, skipping None; None when every item is None."""
    total = None
    for item in items:
        if item is not None:
            total = item.clone() if total is None else total.add_(item)
    return total


def _source_ranks(group: Any) -> Tuple[Tuple[int, int], ...]:
    from megatron.core import parallel_state

    ranks = _SOURCE_RANKS.get(group)
    if ranks is None:
        mine = torch.tensor([parallel_state.get_data_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()])
        pieces = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(pieces, mine, group=group)
        ranks = _SOURCE_RANKS[group] = tuple((int(piece[0]), int(piece[1])) for piece in pieces)
    return ranks


def _sources(dispatcher: Any) -> Tuple[Tuple[int, int], ...]:
    """The (DP rank, TP rank) of the ranks whose tokens reach this rank's experts, in group rank order."""
    if dispatcher.tp_size > 1 or dispatcher.ep_size > 1:
        return _source_ranks(dispatcher.tp_ep_group)
    from megatron.core import parallel_state

    return ((parallel_state.get_data_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),)


def _hand_over(counts: torch.Tensor, sources: Tuple[Tuple[int, int], ...]) -> None:
    """Hand the experts `counts[source, local expert]` as `((DP rank, TP rank), count)` segments in delivery order."""
    segments = [[(source, int(counts[index, expert])) for index, source in enumerate(sources)]
                for expert in range(counts.shape[1])]
    _HANDOVER.update(segments=segments)


Segments = List[Tuple[int, List[Tuple[int, int]]]]


def microbatch_segments(keyed: List[Tuple[Tuple[int, int], int]], start: int) -> Segments:
    """`[(source DP rank, its (start, stop) row ranges in sequence order)]` of one expert's delivered segments,
    the first at row `start`: the sequence shards of one microbatch (its DP rank's TP ranks) in TP rank order,
    i.e. the microbatch's tokens in the order world size 1 has them."""
    by_microbatch: Dict[int, List[Tuple[int, int, int]]] = {}
    for (dp_rank, tp_rank), count in keyed:
        by_microbatch.setdefault(dp_rank, []).append((tp_rank, start, start + count))
        start += count
    return [(dp_rank, [(first, stop) for _, first, stop in sorted(shards)])
            for dp_rank, shards in by_microbatch.items()]


def allgather_dispatch_postprocess(wrapped, instance, args, kwargs):
    """wrapt wrapper of `MoEAllGatherTokenDispatcher.dispatch_postprocess`: hand the per-source token
    counts of each local expert (read off its `local_map`) to the experts' forward."""
    result = wrapped(*args, **kwargs)
    local_map, sources = instance.local_map, _sources(instance)
    _hand_over(local_map.reshape(len(sources), -1, local_map.shape[-1]).sum(dim=1), sources)
    return result


def alltoall_source_order(etp: int, ep: int) -> List[int]:
    """The TP x EP group ranks (`ep_rank * etp + etp_rank`) in the order the alltoall dispatcher delivers their
    tokens under expert TP: ETP-rank-major (the all-to-all's output gathered over ETP)."""
    return [ep_rank * etp + etp_rank for etp_rank in range(etp) for ep_rank in range(ep)]


def alltoall_dispatch_preprocess(wrapped, instance, args, kwargs):
    """wrapt wrapper of `MoEAlltoAllTokenDispatcher.dispatch_preprocess(hidden, routing_map, probs)`:
    the all-to-all delivers each source's tokens in EP group rank order and `sort_chunks_by_idxs`
    groups them by local expert keeping that order, so the per-source counts of each local expert
    are every source's routing-map column sums (one small all-gather over the TP x EP group). Under
    expert TP the all-to-all's output is then gathered over ETP, so sources
    arrive ETP-rank-major, while the group ranks them EP-major (`ep_rank * tp_size + tp_rank`, as
    Megatron reads them)."""
    routing_map = args[1] if len(args) > 1 else kwargs["routing_map"]
    sources = _sources(instance)
    counts = routing_map.sum(dim=0).long()
    if len(sources) > 1:
        pieces = [torch.empty_like(counts) for _ in sources]
        torch.distributed.all_gather(pieces, counts, group=instance.tp_ep_group)
        order = alltoall_source_order(instance.tp_size, instance.ep_size)
        pieces, sources = [pieces[i] for i in order], tuple(sources[i] for i in order)
    else:
        pieces = [counts]
    first, last = instance.local_expert_indices[0], instance.local_expert_indices[-1]
    _hand_over(torch.stack(pieces)[:, first:last + 1], sources)
    return wrapped(*args, **kwargs)


class _ExpertSegment(torch.autograd.Function):
    """One expert on one source's tokens, in fixed chunks; backward adds the chained weight grads
    into the lane of the source's global microbatch."""

    @staticmethod
    def forward(ctx, tokens, probs, expert, source_dp_rank):
        ctx.params = [param for param in expert.parameters() if param.requires_grad]
        ctx.source_dp_rank, ctx.rows, ctx.chunks = source_dp_rank, tokens.shape[0], []
        outputs = []
        for start, stop in chunk_bounds(tokens.shape[0], CHUNK_TOKENS):
            with torch.enable_grad():
                chunk_tokens = padded(tokens[start:stop].detach(), CHUNK_TOKENS).requires_grad_()
                chunk_probs = padded(probs[start:stop].detach(), CHUNK_TOKENS).requires_grad_()
                output = scaled_expert(expert, chunk_tokens, chunk_probs)
            ctx.chunks.append((chunk_tokens, chunk_probs, output))
            outputs.append(output.detach()[: stop - start])
        return torch.cat(outputs)

    @staticmethod
    def backward(ctx, grad):
        grad_tokens, grad_probs, per_chunk = [], [], []
        for (start, stop), (chunk_tokens, chunk_probs, output) in zip(
            chunk_bounds(ctx.rows, CHUNK_TOKENS), ctx.chunks
        ):
            grads = torch.autograd.grad(output, [chunk_tokens, chunk_probs, *ctx.params],
                                        padded(grad[start:stop], CHUNK_TOKENS), allow_unused=True)
            grad_tokens.append(grads[0][: stop - start])
            grad_probs.append(grads[1][: stop - start])
            per_chunk.append(grads[2:])
        ctx.chunks = []
        _add_to_lanes(ctx.params, per_chunk, ctx.source_dp_rank)
        return torch.cat(grad_tokens), torch.cat(grad_probs), None, None


def _add_to_lanes(params: List[Any], per_chunk: List[tuple], source_dp_rank: int) -> None:
    from megatron.core import parallel_state

    from megatron_lora_patch.layout_invariant.lanes import MICROBATCHES, lanes_of_param

    if MICROBATCHES.current is None:
        raise LayoutInvariantUnsupported(
            "layout_invariant: an expert's backward ran outside Megatron's schedule (backward_step), so its "
            "global microbatch is unknown; run backward through get_forward_backward_func()"
        )
    microbatch = MICROBATCHES.current * parallel_state.get_data_parallel_world_size() + source_dp_rank
    for index, param in enumerate(params):
        total = chained([grads[index] for grads in per_chunk])
        if total is not None:
            lanes_of_param(param).add_global(param, total, microbatch)


def _run_segment(expert: Any, tokens: torch.Tensor, probs: torch.Tensor, source_dp_rank: int) -> torch.Tensor:
    if torch.is_grad_enabled():
        return _ExpertSegment.apply(tokens, probs, expert, source_dp_rank)
    outputs = [scaled_expert(expert, padded(tokens[start:stop], CHUNK_TOKENS), padded(probs[start:stop], CHUNK_TOKENS))
               [: stop - start] for start, stop in chunk_bounds(tokens.shape[0], CHUNK_TOKENS)]
    return torch.cat(outputs)


def sequential_forward(wrapped, instance, args, kwargs):
    """wrapt wrapper of `SequentialMLP.forward(hidden, tokens_per_expert, probs)`: every local expert
    on every source segment in fixed chunks; returns `(output, None)` as Megatron does."""
    hidden, tokens_per_expert, probs = _forward_arguments(*args, **kwargs)
    if not _HANDOVER:
        raise LayoutInvariantUnsupported(
            "layout_invariant: SequentialMLP ran without the token dispatcher's segment counts; use "
            "moe_token_dispatcher_type='allgather' or 'alltoall'"
        )
    segments = _HANDOVER.pop("segments")
    if [sum(count for _, count in keyed) for keyed in segments] != [int(count) for count in tokens_per_expert]:
        raise LayoutInvariantUnsupported(
            "layout_invariant: the experts' token counts do not match the dispatcher's routing map; "
            "turn the layout_invariant patch off for this MoE set-up"
        )
    by_start, offset = {}, 0
    for expert, keyed in zip(instance.local_experts, segments):
        for source_dp_rank, ranges in microbatch_segments(keyed, offset):
            counts = [stop - start for start, stop in ranges]
            if sum(counts):
                tokens = torch.cat([hidden[start:stop] for start, stop in ranges])
                weights = torch.cat([probs[start:stop] for start, stop in ranges])
                shards = _run_segment(expert, tokens, weights, source_dp_rank).split(counts)
                by_start.update((start, shard) for (start, _), shard in zip(ranges, shards) if shard.shape[0])
        offset += sum(count for _, count in keyed)
    outputs = [by_start[start] for start in sorted(by_start)]  # back in delivery order
    if not outputs:
        # no token reached these experts: the output still depends on hidden and probs, as Megatron's (run on
        # empty tensors) does, so this rank joins the dispatcher's backward collectives like every other rank
        return hidden[:0] * probs[:0, None], None
    return torch.cat(outputs), None


def _forward_arguments(permuted_local_hidden_states, tokens_per_expert, permuted_probs, **unused):
    return permuted_local_hidden_states, tokens_per_expert, permuted_probs
