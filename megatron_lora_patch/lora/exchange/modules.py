"""Fully trained modules in the Hugging Face PEFT format (PEFT's `modules_to_save`; lora/layers/trained_fully.py).

PEFT (0.21) saves a `modules_to_save` module's weight under the wrapped module's own name,
without the `modules_to_save.<adapter>` segment it has in memory, and `PeftModel.from_pretrained`
maps it back: `base_model.model.lm_head.weight`, `base_model.model.model.embed_tokens.weight`;
`adapter_config.json` lists the modules by last name (`["lm_head"]`). For the Llama-style
families of `family_table.FAMILIES`:

| Megatron module            | Hugging Face module  | PEFT `modules_to_save` entry |
|----------------------------|----------------------|------------------------------|
| output_layer               | lm_head              | lm_head                      |
| embedding.word_embeddings  | model.embed_tokens   | embed_tokens                 |

Tied embeddings (one Megatron weight) export as PEFT writes a tied model's adapter with
`ensure_weight_tying=true`: `modules_to_save: ["embed_tokens"]`, the weight under both names, and
`peft` ties `lm_head` to the trained embedding; import requires that layout (an untied PEFT pair
cannot be one Megatron weight). The weights are the logical (world-size-1) ones, all vocabulary rows
Megatron holds (a vocabulary Megatron-LM padded keeps its padding rows; the Hugging Face model must
have as many).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron_lora_patch.lora.exchange.names import PEFT_PREFIX
from megatron_lora_patch.lora.layers.trained_fully import TIED, saved_modules

HF_MODULES = {"output_layer": "lm_head", "embedding.word_embeddings": "model.embed_tokens"}


def _peft_key(name: str) -> str:
    return f"{PEFT_PREFIX}{HF_MODULES[name]}.weight"


def _peft_entry(name: str) -> str:
    return HF_MODULES[name].rsplit(".", 1)[-1]


def to_peft(full: Dict[str, torch.Tensor], description: dict) -> Tuple[Dict[str, torch.Tensor], dict]:
    """PEFT tensors and config fields (`modules_to_save`: None when nothing trains fully;
    `ensure_weight_tying`) of the fully trained weights `full` (canonical module name -> logical weight)."""
    if description.get("tied_embeddings") and full:
        weight = full[TIED].contiguous()  # a copy per name: safetensors refuses shared storage
        tensors = {_peft_key(TIED): weight, _peft_key("output_layer"): weight.clone()}
        return tensors, {"modules_to_save": [_peft_entry(TIED)], "ensure_weight_tying": True}
    tensors = {_peft_key(name): weight.contiguous() for name, weight in full.items()}
    return tensors, {
        "modules_to_save": sorted(_peft_entry(name) for name in full) or None,
        "ensure_weight_tying": False,
    }


def split(tensors: Dict[str, torch.Tensor], config: dict, description: dict, where: str, error: type) -> tuple:
    """(LoRA tensors, canonical module name -> full weight): the fully trained weights taken out of
    PEFT `tensors`; the adapter's `modules_to_save` must train what the model does (else `error`, one line)."""
    expected = saved_modules(description)
    listed = config.get("modules_to_save") or []
    listed = [listed] if isinstance(listed, str) else listed
    by_entry = {_peft_entry(name): name for name in HF_MODULES}
    entries = sorted({str(entry).rsplit(".", 1)[-1] for entry in listed})  # peft may add "model.embed_tokens"
    unknown = [entry for entry in entries if entry not in by_entry]
    if unknown:
        raise error(
            f"{where}: modules_to_save entry {unknown[0]!r} cannot train fully in Megatron; supported: "
            f"{', '.join(by_entry)}"
        )
    tied = bool(expected and description.get("tied_embeddings"))
    if tied and not (config.get("ensure_weight_tying") and _peft_entry(TIED) in entries):
        raise error(
            f"{where}: the model's tied embeddings train fully as one weight, the adapter needs "
            "modules_to_save with embed_tokens and ensure_weight_tying=true (train it so in peft)"
        )
    want = sorted(_peft_entry(name) for name in expected)
    if not tied and entries != want:
        fix = "MEGATRON_LORA_MODULES_TO_SAVE=" + ",".join(by_entry[entry] for entry in entries)
        raise error(
            f"{where}: modules_to_save={entries} but the model trains fully {want}; build it with "
            f"{fix if entries else 'MEGATRON_LORA_MODULES_TO_SAVE unset'}"
        )
    rest = dict(tensors)
    full = {}
    for name in expected:
        if _peft_key(name) not in rest:
            raise error(f"{where}: missing {_peft_key(name)} (the fully trained Megatron {name})")
        full[name] = rest.pop(_peft_key(name))
    copy = rest.pop(_peft_key("output_layer"), None) if tied else None
    if copy is not None and not torch.equal(copy, full[TIED]):
        raise error(f"{where}: {_peft_key('output_layer')} differs from the tied embedding it must equal")
    return rest, full
