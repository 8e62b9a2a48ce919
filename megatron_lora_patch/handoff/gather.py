"""The logical (world-size-1) adapters of a live model, gathered from their shards onto one rank.

Every rank holds slices of the logical adapters (docs/architecture.md section 4): a TP / expert-TP
shard of one factor, a replica of the other, only its pipeline stage's layers and its EP rank's
experts, and DP / expert-DP replicas of all that. `plan` lists every shard of the world from one
`all_gather_object` of plain data (names, shapes, TP positions: no tensor values), and picks for each
logical tensor one TP group to send it: the group holding `dst` when there is one (its shards do not
travel at all), else the lowest-ranked one. `collect` then moves, per unit of names (one transformer
layer), exactly those shards to `dst` point to point (`send` / `recv`, in one global order, so it
cannot deadlock) and reassembles them with `layouts.unshard`, the inverse of the split `LoraAdapter`
made at init. Traffic is the adapter bytes `dst` lacks, nothing else: no base weight, no collective
over the world beyond the metadata exchange (docs/handoff.md section 1).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from megatron_lora_patch.lora import inventory
from megatron_lora_patch.lora.adapters.layouts import unshard
from megatron_lora_patch.lora.layers import trained_fully

Key = Tuple[str, str]  # (canonical module name, "A" | "B" | "W")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One rank's local slice of one logical tensor (picklable; no values)."""

    name: str  # canonical module name
    factor: str  # "A", "B" (LoRA factors) or "W" (a fully trained weight, `modules_to_save`)
    rank: int  # global rank holding it
    group: Tuple[int, ...]  # global ranks of its TP group, in TP-rank order
    dim: Optional[int]  # the dimension it is sharded on over `group`; None: replicated there
    stride: int  # Megatron's partition stride of that dimension (2: SwiGLU fc1 `[gate_r; up_r]`)
    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def key(self) -> Key:
        return self.name, self.factor

    def logical_shape(self) -> Tuple[int, ...]:
        shape = list(self.shape)
        if self.dim is not None:
            shape[self.dim] *= len(self.group)
        return tuple(shape)


def _world() -> Tuple[int, int]:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def world_size() -> int:
    return _world()[1]


def _group_ranks(group) -> Tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group)) if dist.is_initialized() else (0,)


def local_tensors(chunks: Iterable[torch.nn.Module]) -> Dict[Key, Tuple[Piece, torch.Tensor]]:
    """This rank's adapter factors and fully trained weight shards, each with its `Piece`."""
    chunks = list(chunks)
    me, _ = _world()
    found: Dict[Key, Tuple[Piece, torch.Tensor]] = {}
    for name, adapter in inventory.adapters_of(chunks).items():
        group = _group_ranks(adapter.tp_group)
        sharded = "B" if adapter.parallel_mode == "column" else "A"
        for factor in ("A", "B"):
            param = getattr(adapter, factor)
            tensor = param.detach()  # a detached tensor has no attributes: the stride is the parameter's
            dim = (0 if factor == "B" else 1) if factor == sharded else None
            stride = getattr(param, "partition_stride", 1) if dim is not None else 1
            found[(name, factor)] = (Piece(name, factor, me, group, dim, stride, tuple(tensor.shape), tensor.dtype),
                                     tensor)
    for module, name in trained_fully.trained_weights(inventory.single_model(chunks)):
        tensor = module.weight.detach()  # vocabulary rows: sharded on dim 0 over the module's TP group
        found[(name, "W")] = (Piece(name, "W", me, _group_ranks(module.tp_group), 0, 1, tuple(tensor.shape),
                                    tensor.dtype), tensor)
    return found


def plan(local: Dict[Key, Tuple[Piece, torch.Tensor]], dst: int) -> Dict[Key, List[Piece]]:
    """Logical tensor -> the pieces that make it, in TP-rank order (collective: one `all_gather_object`)."""
    import torch.distributed as dist

    pieces = [piece for piece, _ in local.values()]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: List[Optional[List[Piece]]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, pieces)
        pieces = [piece for part in gathered for piece in part or ()]
    by_key: Dict[Key, Dict[Tuple[int, ...], List[Piece]]] = {}
    for piece in pieces:
        by_key.setdefault(piece.key, {}).setdefault(piece.group, []).append(piece)
    chosen: Dict[Key, List[Piece]] = {}
    for key, groups in sorted(by_key.items()):
        group = next((g for g in groups if dst in g), min(groups))
        members = sorted(groups[group], key=lambda piece: group.index(piece.rank))
        chosen[key] = members if members[0].dim is not None else members[:1]  # a replica: its first holder
    return chosen


def units(keys: Iterable[Key]) -> List[Tuple[str, List[Key]]]:
    """The keys cut into transfer units: one per transformer layer (in layer order), then the rest
    (fully trained weights) as `"modules_to_save"`."""
    layers: Dict[int, List[Key]] = {}
    rest: List[Key] = []
    for key in sorted(keys):
        match = _LAYER.match(key[0])
        (layers.setdefault(int(match.group(1)), []) if match else rest).append(key)
    cut = [(f"decoder.layers.{layer}", layers[layer]) for layer in sorted(layers)]
    return cut + ([("modules_to_save", rest)] if rest else [])


def collect(keys: List[Key], chosen: Dict[Key, List[Piece]], local: Dict[Key, Tuple[Piece, torch.Tensor]],
            dst: int) -> Dict[Key, torch.Tensor]:
    """The logical tensors of `keys` on `dst` (CPU); {} elsewhere (collective over the senders and `dst`)."""
    import torch.distributed as dist

    me, _ = _world()
    device = next((tensor.device for _, tensor in local.values()), torch.device("cpu"))
    parts: Dict[Key, List[torch.Tensor]] = {}
    for key in keys:
        for piece in chosen[key]:
            if piece.rank == me:
                tensor = local[key][1]
                if me == dst:
                    parts.setdefault(key, []).append(tensor)
                else:
                    dist.send(tensor.contiguous(), dst)
            elif me == dst:
                buffer = torch.empty(piece.shape, dtype=piece.dtype, device=device)
                dist.recv(buffer, piece.rank)
                parts.setdefault(key, []).append(buffer)
    logical = {}
    for key, shards in parts.items():
        first = chosen[key][0]
        whole = shards[0] if first.dim is None else unshard(shards, first.dim, first.stride)
        logical[key] = whole.to("cpu", copy=True).contiguous()
    return logical
