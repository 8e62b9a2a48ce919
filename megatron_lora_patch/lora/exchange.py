"""Moving whole adapters in and out: checkpoint -> logical adapters -> PEFT, and PEFT -> this rank's shards.

`export_peft(checkpoint_dir, out_dir)` needs no model and no world: it reads the
adapter-only distributed checkpoint (any topology saved it; Megatron's loader returns
the full logical tensors, stacked over layers and experts) and writes the PEFT files.
`import_peft(chunks, peft_dir)` runs on every rank of any topology and copies each
rank's slice of the logical adapters into its parameters.
"""

from __future__ import annotations

import contextlib
import re
from typing import Dict, Iterable, Iterator, Tuple

import torch

from . import checkpoint, peft
from .adapter import LoraAdapter
from .layouts import shard

_STACKED_KEY = re.compile(r"^decoder\.layers\.(?P<module>.+?)\.lora\.(?P<factor>[AB])$")


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """Megatron's checkpoint loader needs torch.distributed: a private 1-rank gloo group if none exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def logical_from_checkpoint(directory: str) -> Tuple[dict, peft.Logical]:
    """(description, canonical module name -> logical (A, B)) of an adapter-only checkpoint."""
    from megatron.core import dist_checkpointing

    description = checkpoint.read_description(directory)
    with _process_group():
        plain = dist_checkpointing.load_plain_tensors(directory)
    factors: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in plain.items():
        if not isinstance(tensor, torch.Tensor):
            continue  # the common-state description
        match = _STACKED_KEY.match(key)
        if match is None:
            raise checkpoint.AdapterCheckpointError(f"{directory}: unexpected tensor {key!r} in an adapter checkpoint")
        module, factor = match.group("module"), match.group("factor")
        for layer, per_layer in enumerate(tensor.unbind(0)):  # axis 0: global layer index
            if module.startswith("mlp.experts."):
                linear = module[len("mlp.experts."):]
                for expert, value in enumerate(per_layer.unbind(0)):  # axis 1: global expert index
                    name = f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{linear}"
                    factors.setdefault(name, {})[factor] = value.clone()
            else:
                factors.setdefault(f"decoder.layers.{layer}.{module}", {})[factor] = per_layer.clone()
    return description, {name: (pair["A"], pair["B"]) for name, pair in sorted(factors.items())}


def export_peft(checkpoint_dir: str, out_dir: str, family: str = "llama") -> Dict[str, torch.Tensor]:
    """Write the PEFT adapter of an adapter-only checkpoint to `out_dir`; returns the PEFT tensors."""
    description, logical = logical_from_checkpoint(checkpoint_dir)
    tensors, config = peft.to_peft(logical, description, family)
    peft.write(out_dir, tensors, config)
    return tensors


def _all_adapter_names(local: Iterable[str]) -> set:
    """Adapted module names over every rank (pipeline stages and expert ranks hold different ones)."""
    import torch.distributed as dist

    names = set(local)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(names))
        names = set().union(*gathered)
    return names


def _tp_position(adapter: LoraAdapter) -> Tuple[int, int]:
    from megatron.core.utils import get_pg_rank, get_pg_size

    return get_pg_rank(adapter.tp_group), get_pg_size(adapter.tp_group)


def _logical_shapes(adapter: LoraAdapter) -> Tuple[tuple, tuple]:
    _, world = _tp_position(adapter)
    a_shape, b_shape = list(adapter.A.shape), list(adapter.B.shape)
    if adapter.parallel_mode == "column":
        b_shape[0] *= world
    else:
        a_shape[1] *= world
    return tuple(a_shape), tuple(b_shape)


def _local_slices(adapter: LoraAdapter, lora_a: torch.Tensor, lora_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) cut from the logical factors, the way the adapter was sharded at init."""
    rank, world = _tp_position(adapter)
    if adapter.parallel_mode == "column":
        return lora_a, shard(lora_b, 0, rank, world, getattr(adapter.B, "partition_stride", 1))
    return shard(lora_a, 1, rank, world), lora_b


def load_logical(chunks: Iterable[torch.nn.Module], logical: peft.Logical) -> None:
    """Copy this rank's slices of `logical` (canonical name -> (A, B)) into its adapters."""
    with torch.no_grad():
        for name, adapter in checkpoint.adapters_of(chunks).items():
            local_a, local_b = _local_slices(adapter, *logical[name])
            adapter.A.copy_(local_a)
            adapter.B.copy_(local_b)


def import_peft(chunks: Iterable[torch.nn.Module], peft_dir: str) -> None:
    """Load a PEFT LoRA adapter into this rank's adapters (collective over the world: call on every rank)."""
    chunks = list(chunks)
    description = checkpoint.describe(chunks)
    local = checkpoint.adapters_of(chunks)
    tensors, config = peft.read(peft_dir)
    logical = peft.from_peft(tensors, config, description, _all_adapter_names(local), where=peft_dir)
    peft.check_shapes(
        {name: logical[name] for name in local}, {name: _logical_shapes(a) for name, a in local.items()}, peft_dir
    )
    load_logical(chunks, logical)
