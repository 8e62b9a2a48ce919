"""Packed (THD) synthetic batches: several sequences of unequal lengths per row, as SFT data is fed.

Every row of `seq_length` tokens holds the sequences of `packed_lengths(seq_length)` back to back
(lengths 1/4, 1/2, 1/4 of the row: unequal, each divisible by 2 * cp for cp <= `MAX_PACKED_CP`,
which Megatron's per-document CP split needs). The tokens are `data.make_global_batch`'s; on top:
- `position_ids` restart at 0 in each sequence;
- `loss_mask` drops, per sequence, a prompt prefix whose length depends on the sample and the
  sequence, and each sequence's last token (its label would be the next sequence's first token),
  on top of the seeded holes: valid-token counts differ per sequence, row, microbatch, DP and CP rank;
- `cu_seqlens` `[G, n + 1]` int32 (Megatron's batch key, one row per sample, no padding: every row
  has the same split, so every rank's CP positions are the same for every microbatch).
The model gets them as Megatron's `PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, max_seqlen_q/kv)`.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_lora_patch.proof.testbed.data import Batch, make_global_batch

#: The largest CP a packed row can be split over (each sequence's length divides by 2 * cp).
MAX_PACKED_CP = 2
#: Fractions of each sequence masked as its prompt, cycled over (sample, sequence).
PROMPT_FRACTIONS = (0.5, 0.0, 0.25, 0.75, 0.0, 0.5, 0.25)


def packed_lengths(seq_length: int) -> tuple:
    """The lengths of the sequences in every packed row: a quarter, a half, a quarter of it."""
    quarter = seq_length // 4
    if seq_length % (4 * MAX_PACKED_CP):
        raise ValueError(
            f"packed data needs a sequence length divisible by {4 * MAX_PACKED_CP} (three sequences per row, "
            f"each divisible by 2 * cp for cp <= {MAX_PACKED_CP}); got {seq_length}"
        )
    return (quarter, 2 * quarter, quarter)


def cu_seqlens_of(seq_length: int) -> torch.Tensor:
    """`[0, l0, l0 + l1, ..., seq_length]` int32 for `packed_lengths(seq_length)`."""
    return torch.tensor([0, *torch.tensor(packed_lengths(seq_length)).cumsum(0).tolist()], dtype=torch.int32)


def make_packed_global_batch(
    seed: int, global_batch_size: int, seq_len: int, vocab_size: int, stream: Optional[torch.Tensor] = None
) -> Batch:
    """`make_global_batch`'s samples packed as the module doc says, plus `cu_seqlens`."""
    batch = make_global_batch(seed, global_batch_size, seq_len, vocab_size, stream)
    bounds = cu_seqlens_of(seq_len).tolist()
    position_ids = torch.cat([torch.arange(end - start) for start, end in zip(bounds, bounds[1:])])
    loss_mask = batch["loss_mask"]
    for sample in range(global_batch_size):
        for index, (start, end) in enumerate(zip(bounds, bounds[1:])):
            fraction = PROMPT_FRACTIONS[(sample + 2 * index) % len(PROMPT_FRACTIONS)]
            loss_mask[sample, start : start + int(round(fraction * (end - start)))] = 0.0
            loss_mask[sample, end - 1] = 0.0
    batch["position_ids"] = position_ids.unsqueeze(0).expand(global_batch_size, -1).contiguous()
    batch["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32).unsqueeze(0).repeat(global_batch_size, 1)
    return batch


def packed_seq_params(cu_seqlens: torch.Tensor):
    """Megatron's `PackedSeqParams` for one microbatch of one packed row (`cu_seqlens` `[1, n + 1]`)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if cu_seqlens.dim() != 2 or cu_seqlens.shape[0] != 1:
        raise ValueError(
            f"packed microbatches hold one row (micro batch size 1); got cu_seqlens of shape {tuple(cu_seqlens.shape)}"
        )
    bounds = cu_seqlens[0].to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, max_seqlen_q=longest, max_seqlen_kv=longest
    )
