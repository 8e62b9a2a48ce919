"""A PEFT adapter directory on disk: `adapter_model.safetensors`, `adapter_config.json` and this
package's `megatron_lora_patch.json` (the model family), written with deterministic bytes."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Tuple

import torch

from megatron_lora_patch.lora.checkpoints import staging
from megatron_lora_patch.lora.exchange.names import (
    CONFIG_NAME,
    LEGACY_METADATA_KEY,
    METADATA_NAME,
    WEIGHTS_NAME,
    PeftFormatError,
)


def write(out_dir: str, tensors: Dict[str, torch.Tensor], config: dict, family: str = "llama") -> None:
    """Write `adapter_model.safetensors`, `adapter_config.json` and `megatron_lora_patch.json` (deterministic bytes)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, WEIGHTS_NAME)
    save_file(tensors, weights, metadata={"format": "pt"})
    os.chmod(weights, 0o666 & ~staging.umask())  # safetensors writes 0600; give it the mode open() gives the JSON
    for name, data in ((CONFIG_NAME, config), (METADATA_NAME, {"family": family})):
        with open(os.path.join(out_dir, name), "w") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
            handle.write("\n")


def _load_json(path: str) -> Any:
    try:
        with open(path) as handle:
            return json.load(handle)
    except ValueError as error:
        raise PeftFormatError(f"{path}: invalid JSON: {error}") from None


def read(peft_dir: str) -> Tuple[Dict[str, torch.Tensor], dict, str]:
    """PEFT tensors, config and model family from a directory, or a one-line `PeftFormatError`.

    The family comes from `megatron_lora_patch.json`, else from the key older exports embedded
    in the config, else it is "llama" (an adapter written by peft itself).
    """
    weights, config_path = os.path.join(peft_dir, WEIGHTS_NAME), os.path.join(peft_dir, CONFIG_NAME)
    for path in (weights, config_path):
        if not os.path.isfile(path):
            raise PeftFormatError(f"{peft_dir}: no {os.path.basename(path)}; expected a PEFT LoRA adapter directory")
    config = _load_json(config_path)
    metadata_path = os.path.join(peft_dir, METADATA_NAME)
    if os.path.isfile(metadata_path):
        metadata = _load_json(metadata_path)
    else:
        metadata = config.get(LEGACY_METADATA_KEY) if isinstance(config, dict) else None
    family = metadata.get("family", "llama") if isinstance(metadata, dict) else "llama"
    return _load_weights(weights), config, family


def _load_weights(path: str) -> Dict[str, torch.Tensor]:
    """The tensors of `path`; a corrupt, truncated or zero-filled file is one `PeftFormatError` line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except SafetensorError as error:
        raise PeftFormatError(
            f"{path} is not a readable safetensors file ({error}); export or copy the adapter again"
        ) from None
