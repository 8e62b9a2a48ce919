"""The PEFT adapter of a live Megatron model, in memory: `adapter_state` and its streaming form `stream`.

Same conversion as the on-disk export (`megatron-lora-patch export`): the logical adapters go through
`lora.exchange.peft.to_peft` (dense projections, `lora.exchange.experts` for experts, `lora.exchange.modules` for
`modules_to_save`), so the tensors and `adapter_config` are those the export writes for a checkpoint
saved by the same model, bit for bit; only the source differs (the live shards, gathered by
`handoff.gather`, instead of a distributed checkpoint). Nothing is written to disk and nothing merged.
The config is computed first from shapes alone (meta tensors through the same `to_peft`), so every
refusal (a family without experts, an incomplete expert layer) comes before any tensor moves.
docs/handoff.md section 1.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron_lora_patch.handoff import agreement, gather
from megatron_lora_patch.lora import inventory
from megatron_lora_patch.lora.exchange import families, names, peft


@dataclasses.dataclass(frozen=True)
class AdapterState:
    """A PEFT LoRA adapter in memory: `config` is `adapter_config.json`'s dict, `tensors` the
    `adapter_model.safetensors` entries under PEFT names (`base_model.model.…`; empty on ranks other
    than `dst`), `family` the Hugging Face family whose names they use."""

    config: dict
    tensors: Dict[str, torch.Tensor]
    family: str
    #: trained with `MEGATRON_LORA_EXPERT_SHARED_OUTER=1`: every expert of a layer holds the same fc1 A and
    #: fc2 B (replicated in these tensors), so `convert(state, "shared_outer")` can write them once
    shared_outer: bool = False


def _to_peft(logical: Dict[gather.Key, torch.Tensor], description: dict,
             family: str) -> Tuple[Dict[str, torch.Tensor], dict]:
    """`peft.to_peft` of gathered tensors: the LoRA pairs (A, B) and the fully trained weights ("W")."""
    pairs = {name: (logical[(name, "A")], logical[(name, "B")]) for name, factor in logical if factor == "A"}
    full = {name: tensor for (name, factor), tensor in logical.items() if factor == "W"}
    return peft.to_peft(pairs, description, family, full)


def _shapes_only(chosen: Dict[gather.Key, list]) -> Dict[gather.Key, torch.Tensor]:
    return {key: torch.empty(pieces[0].logical_shape(), dtype=pieces[0].dtype, device="meta")
            for key, pieces in chosen.items()}


def stream(chunks: Iterable[torch.nn.Module], family: Optional[str] = None, dst: int = 0,
           timeout: float = agreement.DEFAULT_TIMEOUT_S) -> Tuple[dict, Iterator[Tuple[str, Dict[str, torch.Tensor]]]]:
    """(`adapter_config` dict, iterator of (unit, PEFT tensors of that unit)): one unit per transformer
    layer, then `modules_to_save`; the tensors are on `dst` (CPU), empty dicts elsewhere.

    Collective: call on every rank with the same `family` and `dst`, and exhaust the iterator on every rank.
    The ranks agree on that first (`handoff.agreement`): a mismatch, or a rank not calling within `timeout`
    seconds, is one line on every rank, never a hang. `family` is checked against the model (None: inferred)
    by the resolver the export uses. `dst` holds at most one layer's logical adapter and its PEFT tensors at a
    time (plus what the caller keeps).
    """
    config, units, _, _ = _stream(list(chunks), family, dst, timeout, "stream")
    return config, units


def _check_dst(dst: int) -> None:
    world = gather.world_size()
    if not 0 <= dst < world:
        raise names.PeftFormatError(f"dst={dst} is not a rank of this world of {world}; pass the rank that talks "
                                    f"to the engine (0 .. {world - 1})")


def _stream(chunks: List[torch.nn.Module], family: Optional[str], dst: int, timeout: float,
            call: str) -> Tuple[dict, Iterator[Tuple[str, Dict[str, torch.Tensor]]], str, dict]:
    """`stream`'s config and units, the family resolved for the model, and the model's description."""
    agreement.agree(call, dst, family, timeout)  # before anything that could fail on one rank only
    if family is not None:
        names.names_for(family)
    _check_dst(dst)
    description = inventory.describe(chunks)  # the one walk of the model's adapters for its description
    if description.get("dora"):  # the same on every rank (one configuration), so every rank refuses alike
        raise names.PeftFormatError(f"handoff.{call}: DoRA adapters have no hand-off payload: neither SGLang nor "
                                    "vLLM serves DoRA (handoff/engines.py); roll out merged weights (merge_adapters) "
                                    "or train with MEGATRON_LORA_DORA=0")
    family = families.resolve(description, family, what="the model")
    local = gather.local_tensors(chunks)
    chosen = gather.plan(local, dst)
    _, config = _to_peft(_shapes_only(chosen), description, family)

    def tensors() -> Iterator[Tuple[str, Dict[str, torch.Tensor]]]:
        for unit, keys in gather.units(chosen):
            logical = gather.collect(keys, chosen, local, dst)
            yield unit, (_to_peft(logical, description, family)[0] if logical else {})

    return config, tensors(), family, description


def adapter_state(chunks: Iterable[torch.nn.Module], family: Optional[str] = None, dst: int = 0,
                  timeout: float = agreement.DEFAULT_TIMEOUT_S) -> AdapterState:
    """The PEFT adapter of the live model on rank `dst` (collective: call on every rank with the same `family`
    and `dst`; other ranks get the config and no tensors; see `stream` for `family` and `timeout`). Equal, byte
    for byte, to `megatron-lora-patch export --family FAMILY` of a checkpoint the model would save now; load it
    with `peft.set_peft_model_state_dict` (docs/handoff.md section 1)."""
    config, units, family, description = _stream(list(chunks), family, dst, timeout, "adapter_state")
    tensors: Dict[str, torch.Tensor] = {}
    for _, part in units:
        tensors.update(part)
    shared = bool(description.get("expert_shared_outer", False))
    return AdapterState(config, dict(sorted(tensors.items())), family, shared)
