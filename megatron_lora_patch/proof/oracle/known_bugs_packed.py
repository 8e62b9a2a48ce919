"""The known bugs of packed (THD) data the oracle's sensitivity mutations re-introduce, one function each.

Like `known_bugs`: each `install(patcher)` bends one rule of packed training at the place where the
bug lives, through the given `Patcher`, replacing a function where its caller looks it up at call time;
module-level functions, because jobs are pickled to spawned ranks. `oracle.mutations` names them.
"""

from __future__ import annotations

from megatron_lora_patch.runtime.patching import Patcher


def _causal_over_the_row(query_positions, cu_seqlens):
    """`cp_attention.packed_mask` without the sequence boundaries: causal over the whole packed row."""
    import torch

    keys = torch.arange(int(cu_seqlens[-1]))
    masked = keys.unsqueeze(0) > query_positions.unsqueeze(1)
    return masked.view(1, 1, len(query_positions), len(keys))


def attention_across_packed_sequences(patcher: Patcher) -> None:
    """Packed attention masks only the future: a query also sees the earlier sequences of its row
    (a packed batch fed to an attention that ignores `cu_seqlens`)."""
    from megatron_lora_patch.proof.testbed import cp_attention

    patcher.replace(cp_attention, "packed_mask", _causal_over_the_row)


def _row_chunks(batch):
    """`data.packed_cp_rank_slice` that chunks the packed row as if it were one sequence."""
    from megatron_lora_patch.proof.testbed import data

    unpacked = {key: value for key, value in batch.items() if key != "cu_seqlens"}
    return dict(data.cp_rank_slice(unpacked), cu_seqlens=batch["cu_seqlens"])


def cp_chunks_across_sequences(patcher: Patcher) -> None:
    """CP cuts the packed row into 2 * cp chunks of the row (the unpacked split), across sequence
    boundaries, while attention and RoPE expect each sequence cut into its own 2 * cp chunks."""
    from megatron_lora_patch.proof.testbed import data

    patcher.replace(data, "packed_cp_rank_slice", _row_chunks)


def _mask_ignored_on_cp_rank_1(batch):
    """`pretrain.cp_rank_slice` whose CP rank 1 trains on every token (its loss mask all ones)."""
    import torch
    from megatron.core import parallel_state

    from megatron_lora_patch.proof.testbed import data

    sliced = data.cp_rank_slice(batch)
    if parallel_state.get_context_parallel_rank() == 1:
        sliced["loss_mask"] = torch.ones_like(sliced["loss_mask"])
    return sliced


def loss_mask_ignored_on_one_cp_rank(patcher: Patcher) -> None:
    """CP rank 1 drops the loss mask of its chunks (prompt tokens and sequence ends trained)."""
    from megatron_lora_patch.proof.testbed import pretrain

    patcher.replace(pretrain, "cp_rank_slice", _mask_ignored_on_cp_rank_1)
