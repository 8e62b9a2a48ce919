"""Megatron's distributed optimizer on the testbed: finalized grads readable on every rank.

Under `use_distributed_optimizer` DDP reduce-scatters each grad bucket over the data-parallel
(optimizer-instance) group, so after finalize only this rank's shard of `bucket.grad_data` holds
reduced grads; the rest still holds local partial sums. The oracle compares whole grads, so
`gather_reduced_grads` all-gathers the reduced shards back into every bucket. The optimizer reads
only its own shard, which the gather leaves as it was: the step is the one Megatron computes
(docs/architecture.md section 8).
"""

from __future__ import annotations

import torch


def gather_reduced_grads(chunks: list) -> None:
    """After finalize: every DDP bucket's grad buffer holds the reduced grads of all its shards."""
    for chunk in chunks:
        for bucket_group in list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups):
            size = bucket_group.intra_distributed_optimizer_instance_size
            if size == 1:
                continue
            rank = bucket_group.intra_distributed_optimizer_instance_rank
            for bucket in bucket_group.buckets:
                # Megatron pads each bucket to a multiple of the group size and shards it evenly.
                shards = list(bucket.grad_data.view(size, -1))
                local = shards[rank].clone()
                torch.distributed.all_gather(
                    shards, local, group=bucket_group.intra_distributed_optimizer_instance_group
                )
