"""DoRA's magnitude `m` after a base load: `||W + s B A||` of the weights that were loaded, not of the init.

`attach_adapters` sets `m` from the weights the model has then, which in a Megatron-LM run are a random
init: the base checkpoint loads afterwards. A load from a base checkpoint (no adapters in it:
`--pretrained-checkpoint`, `--load BASE --finetune`) leaves the adapters out of the request
(`checkpoints/megatron.py`); this module then sets every left-out `m` from the base weight the same load
returned, before Megatron copies the state into the model and `reload_model_params` copies the model into
the optimizer's main params. A checkpoint with adapters restores `m` as saved. Code that loads base
weights on its own calls `reset_magnitudes(model)` after the load.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Tuple

import torch

from megatron_lora_patch.lora.adapters.adapter import LoraAdapter
from megatron_lora_patch.lora.adapters.dora import MAGNITUDE
from megatron_lora_patch.lora.adapters.metadata import ADAPTER_NAME
from megatron_lora_patch.runtime.errors import UsageError

_SUFFIX = f"{ADAPTER_NAME}.{MAGNITUDE}"


class MagnitudeInitError(UsageError):
    """DoRA's magnitude cannot be set from the base weights (one line naming the weight)."""


def _dora_adapters(models: Iterable[torch.nn.Module]) -> Dict[int, LoraAdapter]:
    """id(m) -> its adapter, for every DoRA adapter of `models`."""
    return {
        id(module.m): module
        for model in models
        for module in model.modules()
        if isinstance(module, LoraAdapter) and module.magnitude is not None
    }


def set_from_loaded_base(loaded: dict, slots: List[Tuple[Tuple, Any]], models: Iterable[torch.nn.Module]) -> int:
    """Set each DoRA `m` among the left-out adapter `slots` (path, ShardedTensor) from its layer's base weight in
    the `loaded` state (same path, `weight` for `lora.m`); returns how many. Collective over TP for row-parallel
    layers: every rank walks the slots in the model's order."""
    adapters = _dora_adapters(models)
    count = 0
    for path, entry in slots:
        adapter = adapters.get(id(entry.data))
        if adapter is None or not path[-1].endswith(_SUFFIX):
            continue
        container = loaded
        for key in path[:-1]:
            container = container.get(key, {})
        weight_key = path[-1][: -len(_SUFFIX)] + "weight"
        weight = container.get(weight_key)
        if not isinstance(weight, torch.Tensor):
            raise MagnitudeInitError(
                f"DoRA needs the base weight {weight_key} to set {path[-1]}, but the load did not return it; "
                "load a base checkpoint that holds it or set MEGATRON_LORA_DORA=0"
            )
        adapter.reset_magnitude(weight.to(device=adapter.A.device, dtype=adapter.A.dtype))
        count += 1
    return count


def reset_magnitudes(model: torch.nn.Module) -> int:
    """Set every DoRA `m` of `model` from its layer's weight now (after loading base weights by other means than
    a Megatron checkpoint); returns how many. Collective over TP: call on every rank."""
    count = 0
    for layer in model.modules():
        adapter = layer._modules.get(ADAPTER_NAME)
        if isinstance(adapter, LoraAdapter) and adapter.magnitude is not None:
            adapter.reset_magnitude(layer.weight)
            count += 1
    return count
