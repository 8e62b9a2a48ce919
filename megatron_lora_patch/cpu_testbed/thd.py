"""Transformer Engine's THD context-parallel partition, on the host (TE's CUDA kernel has no CPU path).

Megatron-Core 0.19 cuts a packed (THD) microbatch over CP in
`megatron.core.utils._get_batch_on_this_cp_rank_per_document_balancing`, which calls
`transformer_engine_torch.thd_get_partitioned_indices(cu_seqlens, total_tokens, cp_size, cp_rank)`
through the module's `tex` alias (None without TE). Its definition, written from TE's documented
semantics: every sequence `[cu_seqlens[i], cu_seqlens[i+1])` (length divisible by `2 * cp_size`) is
cut into `2 * cp_size` equal chunks and CP rank r takes chunks r and `2 * cp_size - 1 - r` of each
sequence, sequence after sequence: the load-balanced causal split, per document instead of per row.
The result holds `total_tokens / cp_size` token indices (int32, like TE's), in this rank's local order.
"""

from __future__ import annotations

import types

import torch


def thd_get_partitioned_indices(
    cu_seqlens: torch.Tensor, total_tokens: int, world_size: int, rank: int
) -> torch.Tensor:
    """Indices into the packed row of the tokens CP rank `rank` of `world_size` holds (see module doc)."""
    bounds = [int(value) for value in cu_seqlens.reshape(-1).tolist()]
    if bounds[0] != 0 or bounds[-1] != total_tokens or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"cu_seqlens {bounds} must rise from 0 to total_tokens {total_tokens} (one row of a packed batch)"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a context-parallel group of {world_size}")
    pieces = []
    for start, end in zip(bounds, bounds[1:]):
        if (end - start) % (2 * world_size):
            raise ValueError(
                f"packed sequence [{start}, {end}) has length {end - start}, not divisible by 2 * cp = "
                f"{2 * world_size}; pad every sequence to a multiple of {2 * world_size}"
            )
        chunk = (end - start) // (2 * world_size)
        for index in (rank, 2 * world_size - 1 - rank):
            pieces.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
    return torch.cat(pieces).to(torch.int32) if pieces else torch.zeros(0, dtype=torch.int32)


def install_thd_partition(patcher, utils_module) -> None:
    """Without TE, `megatron.core.utils.tex` is None: give it the one TE function its THD CP split calls."""
    if getattr(utils_module, "tex", None) is None and hasattr(utils_module, "tex"):
        patcher.replace(
            utils_module, "tex", types.SimpleNamespace(thd_get_partitioned_indices=thd_get_partitioned_indices)
        )
