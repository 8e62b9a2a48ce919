"""Gloo-compatible equivalents of the collectives Megatron issues with uneven splits.

Gloo has no uneven `all_gather` (a list of different-sized outputs), no list
`reduce_scatter`, and its `all_to_all_single` takes split sizes only as Python lists.
Megatron uses those forms only in the MoE alltoall dispatcher (uneven token counts per
rank). The replacements move exactly the same values: pad + all_gather + slice for the
gather, all_reduce + slice for the reduce-scatter (the same per-element sum).
Each wrapper defers to Megatron's code for any group whose backend is not gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def as_split_list(split_sizes):
    """Split sizes as a list of Python ints (gloo rejects tensors and numpy arrays)."""
    if split_sizes is None:
        return None
    if hasattr(split_sizes, "tolist"):
        return [int(size) for size in split_sizes.tolist()]
    return [int(size) for size in split_sizes]


def gather_uneven_first_dim_on_gloo(wrapped, instance, args, kwargs):
    """`mappings._gather_along_first_dim(input_, group, output_split_sizes=None, ...)` on gloo."""

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or not _is_gloo(group):
            return wrapped(input_, group, output_split_sizes, use_global_buffer)
        sizes = as_split_list(output_split_sizes)
        padded = input_.new_zeros([max(sizes), *input_.shape[1:]])
        padded[: input_.shape[0]] = input_
        gathered = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(gathered, padded.contiguous(), group=group)
        return torch.cat([chunk[:size] for chunk, size in zip(gathered, sizes)], dim=0)

    return gather(*args, **kwargs)


def reduce_scatter_list_first_dim_on_gloo(wrapped, instance, args, kwargs):
    """`mappings._reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, ...)` on gloo."""

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1 or not _is_gloo(group):
            return wrapped(input_, group, input_split_sizes, use_global_buffer)
        sizes = as_split_list(input_split_sizes)
        summed = input_.contiguous().clone()
        dist.all_reduce(summed, group=group)
        start = sum(sizes[: group.rank()])
        return summed[start : start + sizes[group.rank()]].clone()

    return reduce_scatter(*args, **kwargs)


def all_to_all_with_list_splits(wrapped, instance, args, kwargs):
    """`mappings.all_to_all(group, input_, output_split_sizes_, input_split_sizes, ...)` with list splits.

    Further arguments (0.18+: `use_nccl_stream`) pass through unchanged.
    """

    def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None, *rest, **options):
        splits = as_split_list(output_split_sizes_), as_split_list(input_split_sizes)
        return wrapped(group, input_, *splits, *rest, **options)

    return all_to_all(*args, **kwargs)


def install(patcher, mappings_module) -> None:
    """Apply the gloo equivalents to `megatron.core.tensor_parallel.mappings`."""
    patcher.wrap(mappings_module, "_gather_along_first_dim", gather_uneven_first_dim_on_gloo)
    patcher.wrap(
        mappings_module, "_reduce_scatter_along_first_dim", reduce_scatter_list_first_dim_on_gloo
    )
    patcher.wrap(
        mappings_module,
        "all_to_all",
        all_to_all_with_list_splits,
        reexported_by=(
            "megatron.core.tensor_parallel",
            "megatron.core.transformer.moe.token_dispatcher",
        ),
    )
