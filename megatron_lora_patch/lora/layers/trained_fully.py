"""Modules trained fully beside the adapters (PEFT's `modules_to_save`; docs/architecture.md section 4).

`LoraConfig.modules_to_save` names modules, matched like targets (a last name component such
as `output_layer`, or an fnmatch glob over the canonical qualified name), whose base weights
stay trainable while everything else is frozen. Only modules whose weight Megatron already
trains correctly on every topology qualify (`config.TRAINABLE_MODULES`; any other entry is refused
when the configuration is parsed):

- `output_layer` (a vocab-parallel `ColumnParallelLinear`: each TP rank owns its vocabulary
  rows, so its weight grad is complete per shard; the last pipeline stage holds it);
- `embedding.word_embeddings` (a `VocabParallelEmbedding`, the first stage).

Their grads are synced over DP x CP by Megatron's DDP like any trainable weight, and they keep
Megatron's tensor-parallel attributes, so the grad norm counts each element once. With tied embeddings
(`share_embeddings_and_output_weights`) the two are one weight: naming either trains it, i.e. the
embedding on the first stage and, under PP, the last stage's copy in the output layer, whose grads
Megatron's finalize all-reduces over the embedding group (first and last stage), as in pretraining.

A fully trained parameter carries the attribute `TRAINED_FULLY` (its canonical module name),
which `attach.freeze_base` spares and the adapter-only checkpoint saves.
"""

from __future__ import annotations

from typing import Dict, Iterable, List

import torch

from megatron_lora_patch.lora.config import TRAINABLE_MODULES, LoraConfig, LoraConfigError, module_matches

TIED = "embedding.word_embeddings"  # the one weight of tied embeddings


def trained_modules(entries: Iterable[str]) -> List[str]:
    """The canonical names of the modules that `modules_to_save` entries train fully."""
    entries = tuple(entries)
    return [name for name in TRAINABLE_MODULES if module_matches(name, entries)]


def saved_modules(description: dict) -> List[str]:
    """The modules whose weights a checkpoint of `description` holds (tied: the embedding, once)."""
    trained = trained_modules(description.get("modules_to_save", ()))
    return [TIED] if trained and description.get("tied_embeddings") else trained


def checkpoint_keys(description: dict) -> Dict[str, str]:
    """Checkpoint key -> canonical module name of the fully trained weights a description lists."""
    return {f"{name}.weight": name for name in saved_modules(description)}

#: Attribute on a fully trained parameter: its module's canonical name.
TRAINED_FULLY = "_lora_trained_fully"


def mark(model: torch.nn.Module, config: LoraConfig, labels: dict, adapted: List[str]) -> List[str]:
    """Tag the weights of this chunk's modules named by `config.modules_to_save`; returns their names."""
    label = labels["modules_to_save"]  # each entry matches one of TRAINABLE_MODULES (LoraConfig checks it)
    if not config.modules_to_save:
        return []
    both = [name for name in TRAINABLE_MODULES if name in adapted and module_matches(name, config.modules_to_save)]
    if both:
        raise LoraConfigError(f"{both[0]} is both a LoRA target and in {label}; keep it in one of them")
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    marked = []
    for name in TRAINABLE_MODULES:
        module = module_of(model, name)
        if module is None or getattr(module, "weight", None) is None:
            continue  # another pipeline stage holds it (or, tied at PP 1, the embedding is the output weight)
        if tied or module_matches(name, config.modules_to_save):
            setattr(module.weight, TRAINED_FULLY, name)
            marked.append(name)
    return marked


def module_of(model: torch.nn.Module, name: str):
    """The submodule at the dotted `name`, or None where this pipeline stage lacks it."""
    module = model
    for part in name.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, torch.nn.Module):
            return None
    return module


def is_trained_fully(param: torch.Tensor) -> bool:
    return getattr(param, TRAINED_FULLY, None) is not None


def trained_weights(model: torch.nn.Module) -> List[tuple]:
    """(module, name of the logical weight it holds) of this chunk's fully trained modules; tied, the
    output layer's copy holds the embedding's weight."""
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    found = []
    for name in TRAINABLE_MODULES:
        module = module_of(model, name)
        if module is not None and getattr(module, "weight", None) is not None and is_trained_fully(module.weight):
            found.append((module, "embedding.word_embeddings" if tied else name))
    return found


def state_keys(model: torch.nn.Module) -> set:
    """The (sharded) state-dict keys of this model's fully trained weights."""
    return {name for name, param in model.named_parameters() if is_trained_fully(param)}
