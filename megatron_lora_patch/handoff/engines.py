"""Payloads for the rollout engines' in-memory LoRA loaders, built from an `AdapterState` (no engine import).

- SGLang: `sglang_payload(state, name)` are the keyword arguments of `sglang.Engine.
  load_lora_adapter_from_tensors(lora_name, tensors, config_dict, load_format=None)`
  (python/sglang/srt/entrypoints/engine.py): the engine serializes `tensors` per TP rank itself
  (`MultiprocessingSerializer`) into a `LoadLoRAAdapterFromTensorsReqInput`. Tensors keep PEFT names
  and orientation (A `[r, in]`, B `[out, r]`); the engine slices them for its own TP.
- vLLM: `vllm_payload(state, name, lora_id)` are the fields RL frameworks put on a `LoRARequest`
  subclass carrying tensors (verl's `TensorLoRARequest`: `peft_config`, `lora_tensors`), which their
  patched loader hands to `LoRAModel.from_lora_tensors(lora_model_id, tensors, peft_helper=
  PEFTHelper.from_dict(peft_config), ...)` (vllm/lora/lora_model.py, vllm/lora/peft_helper.py).
  Refused in one line, as vLLM refuses or ignores them: `modules_to_save` (`PEFTHelper._validate_features`),
  per-module `rank_pattern` / `alpha_pattern` (PEFTHelper has one r and alpha), and a 3D-MoE layer
  with only one of gate_up / down adapted (`_stack_moe_lora_weights` asserts both).

docs/handoff.md section 3.
"""

from __future__ import annotations

import re
from typing import Any, Dict

from megatron_lora_patch.handoff.state import AdapterState
from megatron_lora_patch.lora.exchange.names import PeftFormatError

_EXPERTS = re.compile(r"^(.+\.mlp\.experts)(\.base_layer)?\.lora_A\.weight$")


class EngineError(PeftFormatError):
    """The adapter is not one the named engine loads; one-line message."""


def _tensors(state: AdapterState) -> Dict[str, Any]:
    if not state.tensors:
        raise EngineError("the adapter state holds no tensors on this rank; build the payload on the rank "
                          "adapter_state gathered to (its dst)")
    return dict(state.tensors)


def sglang_payload(state: AdapterState, lora_name: str) -> Dict[str, Any]:
    """Keyword arguments of SGLang's `Engine.load_lora_adapter_from_tensors` for `state` on rank `dst`."""
    return {"lora_name": lora_name, "tensors": _tensors(state), "config_dict": dict(state.config)}


def _check_vllm(state: AdapterState) -> None:
    config = state.config
    if config.get("modules_to_save"):
        raise EngineError(f"vLLM loads no modules_to_save ({config['modules_to_save']}); train without "
                          "MEGATRON_LORA_MODULES_TO_SAVE or roll out with SGLang / merged weights")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise EngineError(f"vLLM's PEFTHelper has one r and lora_alpha, {field}={config[field]} would be ignored; "
                              f"train without MEGATRON_LORA_{field.upper()}")
    wrappers: Dict[str, set] = {}
    for key in state.tensors:
        match = _EXPERTS.match(key)
        if match:
            wrappers.setdefault(match.group(1), set()).add(bool(match.group(2)))
    half = sorted(path for path, kinds in wrappers.items() if kinds != {True, False})
    if half:
        raise EngineError(f"{half[0]} adapts only one of gate_up_proj / down_proj; vLLM's 3D-MoE loader needs "
                          "both (target linear_fc1 and linear_fc2 of the experts, or neither)")


def vllm_payload(state: AdapterState, lora_name: str, lora_int_id: int) -> Dict[str, Any]:
    """Fields of a tensor-carrying vLLM `LoRARequest` (verl's `TensorLoRARequest`) for `state`."""
    if lora_int_id < 1:
        raise EngineError(f"vLLM LoRA ids start at 1 (LoRAModel asserts id > 0), got {lora_int_id}")
    tensors = _tensors(state)
    _check_vllm(state)
    return {"lora_name": lora_name, "lora_int_id": lora_int_id, "lora_path": lora_name,
            "peft_config": dict(state.config), "lora_tensors": tensors}
