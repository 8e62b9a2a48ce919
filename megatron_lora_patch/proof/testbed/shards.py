"""Map rank-local Megatron parameters to their slice of the logical (world-size-1) tensor.

A `Shard` says where one local tensor sits in the logical tensor of the same parameter:
its logical name (global layer number, global expert index, tied output -> embedding)
and how tensor parallelism cut it (`partition_dim`, rank and size of the TP or
expert-TP domain; SwiGLU `linear_fc1` cuts gate and up halves separately, because the
local shard is [gate_shard; up_shard]). Megatron's grouped QKV rows are already laid
out per query group, so a contiguous TP cut of the full weight is the local weight.

Use on a rank: `load_logical(chunks, state_dict)` and `canonical_items(chunks, select)`;
in the parent: `assemble_logical(items_of_all_ranks, logical_shapes(spec))`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class Shard:
    """Where a rank-local tensor lives in its logical tensor (`partition_dim=None`: a full replica)."""

    logical_name: str
    partition_dim: Optional[int] = None
    rank: int = 0
    size: int = 1
    gated: bool = False

    def _pieces(self, length: int) -> list[slice]:
        halves = 2 if self.gated else 1
        if length % (halves * self.size):
            raise ValueError(f"{self.logical_name}: dim of {length} does not split into {halves}x{self.size} shards")
        half, piece = length // halves, length // halves // self.size
        return [slice(h * half + self.rank * piece, h * half + (self.rank + 1) * piece) for h in range(halves)]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's values, cut from the logical tensor `full`."""
        if self.partition_dim is None:
            return full
        dim = self.partition_dim
        return torch.cat([full.narrow(dim, s.start, s.stop - s.start) for s in self._pieces(full.shape[dim])], dim)

    def place(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Write `local` (this shard's values) into the logical tensor `full`, in place."""
        if self.partition_dim is None:
            full.copy_(local)
            return
        dim, offset = self.partition_dim, 0
        for s in self._pieces(full.shape[dim]):
            width = s.stop - s.start
            full.narrow(dim, s.start, width).copy_(local.narrow(dim, offset, width))
            offset += width


def shard_of(chunk: torch.nn.Module, local_name: str, parameter: torch.Tensor) -> Shard:
    """The `Shard` of parameter `local_name` of model chunk `chunk` on this rank."""
    from megatron.core import parallel_state

    name = local_name
    layer_match = _LAYER.match(name)
    if layer_match:
        local_layer = int(layer_match.group(1))
        global_layer = chunk.decoder.layers[local_layer].layer_number - 1  # layer_number is global, 1-based
        name = f"decoder.layers.{global_layer}." + name[layer_match.end() :]
        expert_match = _EXPERT.search(name)
        if expert_match:
            moe_layer = chunk.decoder.layers[local_layer].mlp
            global_expert = moe_layer.local_expert_indices[int(expert_match.group(1))]
            name = name[: expert_match.start()] + f".local_experts.{global_expert}." + name[expert_match.end() :]
    if name == "output_layer.weight" and getattr(chunk, "share_embeddings_and_output_weights", False):
        name = "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
    if not getattr(parameter, "tensor_model_parallel", False):
        return Shard(name)
    is_expert = _EXPERT.search(name) is not None
    if is_expert:
        rank = parallel_state.get_expert_tensor_parallel_rank()
        size = parallel_state.get_expert_tensor_parallel_world_size()
    else:
        rank = parallel_state.get_tensor_model_parallel_rank()
        size = parallel_state.get_tensor_model_parallel_world_size()
    # SwiGLU fc1 shards are [gate_shard; up_shard]: the base weight (by name) and any
    # factor that declares Megatron's partition_stride 2 (the fc1 LoRA B).
    gated = getattr(parameter, "partition_stride", 1) == 2 or (
        name.endswith("linear_fc1.weight") and chunk.config.gated_linear_unit
    )
    return Shard(name, parameter.partition_dim, rank, size, gated)


def named_shards(chunks: Iterable[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter, Shard]]:
    """(local name, parameter, shard) of every parameter of this rank's chunks."""
    for chunk in chunks:
        for local_name, parameter in _unwrapped(chunk).named_parameters():
            yield local_name, parameter, shard_of(_unwrapped(chunk), local_name, parameter)


def load_logical(chunks: Iterable[torch.nn.Module], state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Copy each parameter's slice of the logical `state_dict` into this rank's chunks.

    Returns the local names of parameters the state dict does not cover (e.g. adapters
    added by a patch), which are left as they are. Every entry of `state_dict` that this
    rank holds a slice of must match a parameter's shape.
    """
    uncovered = []
    with torch.no_grad():
        for local_name, parameter, shard in named_shards(chunks):
            if shard.logical_name not in state_dict:
                uncovered.append(local_name)
                continue
            value = shard.take(state_dict[shard.logical_name])
            if value.shape != parameter.shape:
                raise ValueError(
                    f"{local_name}: logical slice {tuple(value.shape)} != parameter {tuple(parameter.shape)}"
                )
            parameter.copy_(value)
    return uncovered


def canonical_items(
    chunks: Iterable[torch.nn.Module], select: Callable[[torch.nn.Parameter], Optional[torch.Tensor]] = None
) -> list[tuple[Shard, torch.Tensor]]:
    """(shard, tensor) for each parameter; `select(param)` picks the tensor (default: the weight).

    E.g. `select=lambda p: p.main_grad` for grads after DDP. Parameters where `select`
    returns None are left out. Tensors are detached fp32 CPU copies, ready to send.
    """
    select = select or (lambda parameter: parameter)
    items = []
    for _, parameter, shard in named_shards(chunks):
        tensor = select(parameter)
        if tensor is not None:
            items.append((shard, tensor.detach().to("cpu", torch.float32).clone()))
    return items


def assemble_logical(
    rank_items: Iterable[Iterable[tuple[Shard, torch.Tensor]]],
    shapes: dict[str, tuple[int, ...]],
    *,
    require_complete: bool = True,
) -> dict[str, torch.Tensor]:
    """Logical tensors from the `canonical_items` of every rank (first copy of a replica wins).

    `require_complete` raises if some element of a named tensor came from no rank.
    """
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for items in rank_items:
        for shard, tensor in items:
            if shard.logical_name not in shapes:
                raise KeyError(f"{shard.logical_name!r} is not a logical parameter of this model")
            if shard.logical_name not in full:
                full[shard.logical_name] = torch.zeros(shapes[shard.logical_name])
                covered[shard.logical_name] = torch.zeros(shapes[shard.logical_name], dtype=torch.bool)
            if bool(shard.take(covered[shard.logical_name]).all()):
                continue  # a replica of values already placed
            shard.place(full[shard.logical_name], tensor)
            shard.place(covered[shard.logical_name], torch.ones_like(tensor, dtype=torch.bool))
    if require_complete:
        missing = [name for name in shapes if name not in covered or not bool(covered[name].all())]
        if missing:
            raise ValueError(f"no rank provided (all of) {missing}")
    return full


def _unwrapped(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers (their `.module`)."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk
