"""Deterministic synthetic data, split over DP / microbatches / CP exactly as Megatron-LM splits it.

The global batch is a pure function of its seed and shape, so every rank of every
topology (and the world-size-1 reference) sees the same logical samples. Loss masks
mask a different fraction of every sample (one sample almost entirely), so trainable
token counts differ per DP rank and per microbatch: the property that separates
global token normalization from a mean of per-rank means.

Splitting mirrors Megatron-LM:
- DP: `MegatronPretrainingSampler` reads the sample stream in groups of
  `micro_batch_size * dp`; DP rank r takes the r-th `micro_batch_size` slice of each
  group. So microbatch m of DP rank r holds global samples
  `[(m*dp + r)*mbs, (m*dp + r + 1)*mbs)` (interleaved, not one contiguous block per rank).
- CP: `megatron.core.utils.get_batch_on_this_cp_rank` (load-balanced 2*cp chunks),
  called directly so the chunking is Megatron's own.
- SP is done inside the model (the embedding output is scattered over TP).
"""

from __future__ import annotations

import inspect
import os
from typing import Dict, List, Optional

import torch

Batch = Dict[str, torch.Tensor]

#: Fractions of each sample's tokens masked out of the loss, cycled over the global
#: batch. 0.9 guarantees one heavily masked sample; 0.0 a fully trained one.
MASKED_FRACTIONS = (0.0, 0.9, 0.25, 0.5, 0.1, 0.75, 0.4, 0.6)


def make_global_batch(
    seed: int, global_batch_size: int, seq_len: int, vocab_size: int, stream: Optional[torch.Tensor] = None
) -> Batch:
    """The whole step's batch: tokens, labels (next token), loss_mask, position_ids, all `[G, S]`.

    Masked positions form a prefix (like an SFT prompt) whose length depends on the
    sample index, plus a few seeded random holes, so counts vary per sample. `stream`
    (`G * (S + 1)` token ids, e.g. from `read_corpus`) replaces the random tokens; the
    masks stay the seeded ones, so the normalization property is exercised on real text too.
    """
    if global_batch_size < 1 or seq_len < 2 or vocab_size < 2:
        raise ValueError(
            f"need global_batch_size >= 1, seq_len >= 2, vocab_size >= 2; got "
            f"{global_batch_size}, {seq_len}, {vocab_size}"
        )
    generator = torch.Generator().manual_seed(seed)
    random_stream = torch.randint(0, vocab_size, (global_batch_size, seq_len + 1), generator=generator)
    stream = random_stream if stream is None else stream.reshape(global_batch_size, seq_len + 1).long()
    loss_mask = torch.ones(global_batch_size, seq_len, dtype=torch.float32)
    for sample in range(global_batch_size):
        fraction = MASKED_FRACTIONS[sample % len(MASKED_FRACTIONS)]
        loss_mask[sample, : int(round(fraction * seq_len))] = 0.0
    holes = torch.rand(global_batch_size, seq_len, generator=generator) < 0.1
    loss_mask[holes] = 0.0
    position_ids = torch.arange(seq_len, dtype=torch.long).unsqueeze(0).expand(global_batch_size, -1)
    return {
        "tokens": stream[:, :-1].contiguous(),
        "labels": stream[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": position_ids.contiguous(),
    }


def read_corpus(path_prefix: str, count: int, vocab_size: int) -> torch.Tensor:
    """The first `count` token ids of a Megatron indexed dataset (`PREFIX.bin` / `.idx`), documents in order.

    ValueError (one line) if the files are missing, hold fewer tokens, or hold an id the
    model's vocabulary cannot embed; read with Megatron's own `IndexedDataset`.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    missing = [path_prefix + suffix for suffix in (".bin", ".idx") if not os.path.isfile(path_prefix + suffix)]
    if missing:
        raise ValueError(
            f"--data-path {path_prefix}: {' and '.join(missing)} not found (give the prefix, without .bin/.idx)"
        )
    dataset, pieces, total = IndexedDataset(path_prefix), [], 0
    for index in range(len(dataset)):
        if total >= count:
            break
        pieces.append(torch.from_numpy(dataset[index].astype("int64")))
        total += len(pieces[-1])
    if total < count:
        raise ValueError(
            f"--data-path {path_prefix}: holds {total} tokens, the preflight needs {count}; "
            "use fewer --steps / --micro-batches or a larger dataset"
        )
    tokens = torch.cat(pieces)[:count]
    if int(tokens.max()) >= vocab_size:
        raise ValueError(
            f"--data-path {path_prefix}: token id {int(tokens.max())} is outside your vocabulary of "
            f"{vocab_size}; was it tokenized with the tokenizer of your arguments?"
        )
    return tokens


def num_microbatches_for(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Megatron's `get_num_microbatches()`: global batch / (micro batch * DP); must divide."""
    per_step = micro_batch_size * dp_size
    if global_batch_size % per_step:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not divisible by micro_batch_size * dp = "
            f"{micro_batch_size} * {dp_size}; pick a multiple of {per_step}"
        )
    return global_batch_size // per_step


def dp_rank_microbatches(global_batch: Batch, dp_rank: int, dp_size: int, micro_batch_size: int) -> List[Batch]:
    """The microbatches DP rank `dp_rank` consumes, in order (MegatronPretrainingSampler order)."""
    global_batch_size = next(iter(global_batch.values())).shape[0]
    count = num_microbatches_for(global_batch_size, micro_batch_size, dp_size)
    microbatches = []
    for index in range(count):
        start = (index * dp_size + dp_rank) * micro_batch_size
        microbatches.append(
            {key: value[start : start + micro_batch_size].clone() for key, value in global_batch.items()}
        )
    return microbatches


def cp_rank_slice(batch: Batch) -> Batch:
    """This CP rank's load-balanced share of a microbatch, via Megatron's own function.

    Needs `parallel_state` initialized; a no-op when CP is 1. The CP group is passed
    explicitly: from Megatron-Core 0.18 `cp_group=None` means the whole world, and the
    function takes a required `is_hybrid_cp` flag (False: plain CP). A packed batch
    (`cu_seqlens`) is split per sequence (`packed_cp_rank_slice`).
    """
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    if "cu_seqlens" in batch:
        return packed_cp_rank_slice(batch)
    accepted = inspect.signature(get_batch_on_this_cp_rank).parameters
    if "cp_group" not in accepted:  # older releases: always the global CP group
        return get_batch_on_this_cp_rank(dict(batch))
    extra = {"is_hybrid_cp": False} if "is_hybrid_cp" in accepted else {}
    return get_batch_on_this_cp_rank(dict(batch), cp_group=parallel_state.get_context_parallel_group(), **extra)


def packed_cp_rank_slice(batch: Batch) -> Batch:
    """A packed microbatch's share for this CP rank: each sequence in 2*cp chunks, chunks r and 2cp-1-r.

    Megatron-Core 0.19+ does it itself (`get_batch_on_this_cp_rank` with `cu_seqlens`: per-document
    balancing through TE's `thd_get_partitioned_indices`, which the `cpu_compat` patch supplies on a
    host); older releases cut whole rows only, so there the same TE split is applied here. `cu_seqlens`
    stays whole (attention and RoPE need the global boundaries).
    """
    from megatron.core import parallel_state
    from megatron.core import utils as megatron_utils

    group = parallel_state.get_context_parallel_group()
    if hasattr(megatron_utils, "_get_batch_on_this_cp_rank_per_document_balancing"):
        sliced = megatron_utils.get_batch_on_this_cp_rank(
            dict(batch, cu_seqlens_padded=None), is_hybrid_cp=False, cp_group=group
        )
        sliced.pop("cu_seqlens_padded")
        return sliced
    return thd_split(batch, group)


def thd_split(batch: Batch, group) -> Batch:
    """`packed_cp_rank_slice` without Megatron: TE's per-sequence split applied to every sequence-dim tensor."""
    from megatron_lora_patch.cpu_testbed.thd import thd_get_partitioned_indices

    cp_size, cp_rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    if cp_size == 1:
        return dict(batch)
    index = thd_get_partitioned_indices(batch["cu_seqlens"][0], batch["tokens"].size(1), cp_size, cp_rank)
    return {key: value if key == "cu_seqlens" else value.index_select(1, index) for key, value in batch.items()}


def cp_sequence_positions(seq_len: int, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Which global sequence positions this CP rank holds, in its local order.

    Derived by pushing `arange(seq_len)` through the same Megatron chunking (per sequence of
    `cu_seqlens` `[1, n + 1]` for packed rows), so the oracle can scatter CP-local tensors back to
    world-1 order without re-deriving it.
    """
    batch = {"position_ids": torch.arange(seq_len).unsqueeze(0)}
    if cu_seqlens is not None:
        batch.update(tokens=batch["position_ids"], cu_seqlens=cu_seqlens)
    return cp_rank_slice(batch)["position_ids"][0]
