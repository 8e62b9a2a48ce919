"""Context-parallel core attention for the CPU testbed (Megatron's local spec has none).

Megatron-Core's local `DotProductAttention` asserts `context_parallel_size == 1`: only
Transformer Engine's attention implements CP. So that CP topologies run on CPU + gloo,
`ContextParallelDotProductAttention` gives the local spec Megatron's CP semantics:

- the sequence is cut into 2*cp equal chunks and CP rank r holds chunks r and
  2*cp-1-r, in that order (load-balanced causal work; what
  `megatron.core.utils.get_batch_on_this_cp_rank` gives the data and
  `get_pos_emb_on_this_cp_rank` gives RoPE);
- K and V are all-gathered over the CP group with Megatron's
  `gather_from_sequence_parallel_region` (backward: reduce-scatter of dK / dV, so every
  rank's queries' contribution reaches the rank that owns the key), then put back in
  global sequence order;
- the local queries attend causally, by their global positions, to all keys; the math
  after that is `DotProductAttention.forward` itself (same softmax scale, the same
  `-10000` masked fill, GQA repeat of KV heads), so each query row sees exactly the
  scores world size 1 computes.

Packed sequences (THD, `packed_seq_params.qkv_format == "thd"`, query/key/value `[t/cp, heads, dim]`)
are held per sequence as Megatron's per-document split holds them (`cpu_testbed.thd`: chunks r and
2*cp-1-r of every sequence); a query attends causally within its own sequence and to nothing across
a boundary. The class is then the core attention at every CP size, 1 included (Megatron's local
`DotProductAttention` refuses packed sequences), so world size 1 runs the same packed math.

Testbed only: it gathers the whole K/V (no ring exchange), which is fine for tiny models.
It is used only when cp > 1 (world size 1 stays Megatron's own `DotProductAttention`, so the
reference is Megatron's). With Transformer Engine on a GPU, use the TE spec: its
`TEDotProductAttention` is Megatron's real CP attention. Attention dropout must be 0 for a
CP run to equal world size 1 (the dropout masks are drawn per rank-local score block).

Megatron's RoPE already takes this rank's CP slice (`get_pos_emb_on_this_cp_rank`); its
`pin_memory=True` index tensor is made host-safe by the `cpu_compat` device mapping.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_lora_patch.cpu_testbed.thd import thd_get_partitioned_indices

__all__ = ["ContextParallelDotProductAttention", "cp_chunk_positions", "packed_mask", "rank_positions"]


def cp_chunk_positions(seq_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions CP rank `cp_rank` holds, in local order: chunks r and 2*cp-1-r of 2*cp."""
    if seq_length % (2 * cp_size):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2*cp = {2 * cp_size}")
    chunk = seq_length // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [torch.arange(first * chunk, (first + 1) * chunk), torch.arange(second * chunk, (second + 1) * chunk)]
    )


def rank_positions(seq_length: int, cp_size: int, cp_rank: int, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """Global positions a CP rank holds, in local order: per row (`cu_seqlens` None) or per packed sequence."""
    if cu_seqlens is None:
        return cp_chunk_positions(seq_length, cp_size, cp_rank)
    return thd_get_partitioned_indices(cu_seqlens, seq_length, cp_size, cp_rank).long()


def packed_mask(query_positions: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[1, 1, len(query_positions), total] bool, True = masked: a key in another sequence or after the query."""
    total = int(cu_seqlens[-1])
    sequence_of = torch.bucketize(torch.arange(total), cu_seqlens[1:].long(), right=True)
    keys = torch.arange(total)
    allowed = (sequence_of[keys].unsqueeze(0) == sequence_of[query_positions].unsqueeze(1)) & (
        keys.unsqueeze(0) <= query_positions.unsqueeze(1)
    )
    return (~allowed).view(1, 1, len(query_positions), total)


class ContextParallelDotProductAttention(DotProductAttention):
    """`DotProductAttention` for cp > 1 or packed sequences: local queries against CP-gathered K/V
    (see module doc).

    Takes the constructor arguments of `DotProductAttention` (the spec builds it the same way).
    Not supported (raises): sliding-window attention, packed formats other than THD.
    """

    def __init__(self, config, *args, **kwargs):
        if getattr(config, "window_size", None) is not None:
            raise ValueError(
                "ContextParallelDotProductAttention does not support sliding-window attention; "
                "use the Transformer Engine spec for windowed CP attention"
            )
        # DotProductAttention asserts cp == 1; everything it derives from the config is
        # per-head math that CP does not change. Megatron's SelfAttention builds its core
        # attention from an adjusted config copy the same way (num_query_groups < tp).
        single_rank_view = copy.copy(config)
        single_rank_view.context_parallel_size = 1
        super().__init__(single_rank_view, *args, **kwargs)
        self.config = config
        cp_group = getattr(kwargs.get("pg_collection"), "cp", None)
        self.cp_group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        """query/key/value: [s/cp, b, heads, dim] in CP-local order (THD: [t/cp, heads, dim]);
        returns [s/cp, b, hidden] (THD: [t/cp, 1, hidden])."""
        if packed_seq_params is not None:
            return self.packed_forward(query, key, value, attn_mask_type, attention_bias, packed_seq_params)
        global_key = self.gather_sequence(key)
        global_value = self.gather_sequence(value)
        if attention_mask is None:
            attention_mask = self.causal_mask(query.size(0), query.device)
        # A given mask was cut by get_batch_on_this_cp_rank on its query dim only: its key
        # dim is already in global order, like the gathered K/V.
        return super().forward(query, global_key, global_value, attention_mask, attn_mask_type, attention_bias)

    def packed_forward(self, query, key, value, attn_mask_type, attention_bias, packed_seq_params):
        """THD: each sequence attends causally to itself only; the score math is `DotProductAttention`'s."""
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(
                f"ContextParallelDotProductAttention supports packed sequences in the 'thd' format only; "
                f"got qkv_format={packed_seq_params.qkv_format!r}"
            )
        cu_seqlens = packed_seq_params.cu_seqlens_q.cpu()
        query, key, value = (tensor.unsqueeze(1) for tensor in (query, key, value))
        global_key = self.gather_sequence(key, cu_seqlens)
        global_value = self.gather_sequence(value, cu_seqlens)
        positions = rank_positions(global_key.size(0), self.cp_size, self.cp_rank, cu_seqlens)
        mask = packed_mask(positions, cu_seqlens).to(query.device)
        return super().forward(query, global_key, global_value, mask, attn_mask_type, attention_bias)

    @property
    def cp_size(self) -> int:
        return torch.distributed.get_world_size(self.cp_group)

    @property
    def cp_rank(self) -> int:
        return torch.distributed.get_rank(self.cp_group)

    def gather_sequence(self, local: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[s/cp, ...] CP-local chunks (per packed sequence of `cu_seqlens`, if given) -> [s, ...] in global order."""
        return self.to_global_order(self.all_gather(local), cu_seqlens)

    def all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """Rank blocks concatenated in CP rank order; backward reduce-scatters the grad.

        The reduce-scatter sums, for the keys this rank owns, the grads from every rank's
        queries (a key is attended by queries on all CP ranks).
        """
        return gather_from_sequence_parallel_region(local, tensor_parallel_output_grad=True, group=self.cp_group)

    def to_global_order(self, gathered: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Reorder rank blocks [r0: chunks 0, 2cp-1 | r1: chunks 1, 2cp-2 | ...] (of the row, or of each packed
        sequence) to positions 0..s-1."""
        seq_length = gathered.size(0)
        positions = torch.cat(
            [rank_positions(seq_length, self.cp_size, rank, cu_seqlens) for rank in range(self.cp_size)]
        )
        return gathered.index_select(0, torch.argsort(positions).to(gathered.device))

    def causal_mask(self, local_length: int, device: torch.device) -> torch.Tensor:
        """[1, 1, s/cp, s] bool, True = masked: key position > the local query's global position.

        World size 1 masks `triu(ones(s, s), diagonal=1)` (`get_default_causal_mask`); these are
        its rows for this rank's query positions.
        """
        seq_length = local_length * self.cp_size
        query_positions = cp_chunk_positions(seq_length, self.cp_size, self.cp_rank)
        key_positions = torch.arange(seq_length)
        mask = key_positions.unsqueeze(0) > query_positions.unsqueeze(1)
        return mask.view(1, 1, local_length, seq_length).to(device)
