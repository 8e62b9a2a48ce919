"""Fully trained modules in the Hugging Face PEFT format (PEFT's `modules_to_save`; lora/trained_fully.py).

PEFT (0.21) saves a `modules_to_save` module's weight under the wrapped module's own name,
without the `modules_to_save.<adapter>` segment it has in memory, and `PeftModel.from_pretrained`
maps it back: `base_model.model.lm_head.weight`, `base_model.model.model.embed_tokens.weight`;
`adapter_config.json` lists the modules by last name (`["lm_head"]`). For the Llama-style
families of `peft.NAME_TABLE`:

| Megatron module            | Hugging Face module  | PEFT `modules_to_save` entry |
|----------------------------|----------------------|------------------------------|
| output_layer               | lm_head              | lm_head                      |
| embedding.word_embeddings  | model.embed_tokens   | embed_tokens                 |

The weights are the logical (world-size-1) ones, all vocabulary rows Megatron holds (a
vocabulary Megatron-LM padded keeps its padding rows; the Hugging Face model must have as many).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch

from .config import TRAINABLE_MODULES, module_matches

PEFT_PREFIX = "base_model.model."
HF_MODULES = {"output_layer": "lm_head", "embedding.word_embeddings": "model.embed_tokens"}


def trained_modules(entries: Iterable[str]) -> List[str]:
    """The canonical names of the modules that `modules_to_save` entries train fully."""
    entries = tuple(entries)
    return [name for name in TRAINABLE_MODULES if module_matches(name, entries)]


def checkpoint_keys(description: dict) -> Dict[str, str]:
    """Checkpoint key -> canonical module name of the fully trained weights a description lists."""
    return {f"{name}.weight": name for name in trained_modules(description.get("modules_to_save", ()))}


def _peft_key(name: str) -> str:
    return f"{PEFT_PREFIX}{HF_MODULES[name]}.weight"


def _peft_entry(name: str) -> str:
    return HF_MODULES[name].rsplit(".", 1)[-1]


def to_peft(full: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], "List[str] | None"]:
    """PEFT tensors and the `modules_to_save` config value (None when nothing trains fully)."""
    tensors = {_peft_key(name): weight.contiguous() for name, weight in full.items()}
    return tensors, sorted(_peft_entry(name) for name in full) or None


def split(tensors: Dict[str, torch.Tensor], config: dict, description: dict, where: str, error: type) -> tuple:
    """(LoRA tensors, canonical module name -> full weight): the fully trained weights taken out of
    PEFT `tensors`; the adapter's `modules_to_save` must be exactly the model's (else `error`, one line)."""
    expected = trained_modules(description.get("modules_to_save", ()))
    listed = config.get("modules_to_save") or []
    by_entry = {_peft_entry(name): name for name in HF_MODULES}
    unknown = [entry for entry in listed if entry not in by_entry] if isinstance(listed, list) else [listed]
    if unknown:
        raise error(f"{where}: modules_to_save entry {unknown[0]!r} cannot train fully in Megatron; supported: "
                    f"{', '.join(by_entry)}")
    want = sorted(_peft_entry(name) for name in expected)
    if sorted(listed) != want:
        fix = "MEGATRON_LORA_MODULES_TO_SAVE=" + ",".join(by_entry[entry] for entry in sorted(listed))
        raise error(f"{where}: modules_to_save={sorted(listed)} but the model trains fully {want}; build it with "
                    f"{fix if listed else 'MEGATRON_LORA_MODULES_TO_SAVE unset'}")
    rest = dict(tensors)
    full = {}
    for name in expected:
        if _peft_key(name) not in rest:
            raise error(f"{where}: missing {_peft_key(name)} (the fully trained Megatron {name})")
        full[name] = rest.pop(_peft_key(name))
    return rest, full
