"""Payloads for the rollout engines' in-memory LoRA loaders, built from an `AdapterState` (no engine import).

- SGLang: `sglang_payload(state, name)` are the keyword arguments of `sglang.Engine.
  load_lora_adapter_from_tensors(lora_name, tensors, config_dict, load_format=None)`
  (python/sglang/srt/entrypoints/engine.py): the engine serializes `tensors` per TP rank itself
  (`MultiprocessingSerializer`) into a `LoadLoRAAdapterFromTensorsReqInput`. Tensors keep PEFT names
  and orientation (A `[r, in]`, B `[out, r]`); the engine slices them for its own TP. Its memory pool
  (python/sglang/srt/lora/mem_pool.py, `LoRAMemoryPool.load_lora_weight_to_buffer`) reads routed experts
  per expert (`experts.<e>.` in the name, 2D) or as 3D tensors, never peft's packed 2D `target_parameters`
  wrappers (refused: convert to `per_expert` first); it copies every module into `[:config.r]` rows and
  asserts the shape, and scales by `lora_alpha / r` (`LoRAAdapter.scaling`, no rsLoRA, no patterns).
- vLLM: `vllm_payload(state, name, lora_id)` are the fields RL frameworks put on a `LoRARequest`
  subclass carrying tensors (verl's `TensorLoRARequest`: `peft_config`, `lora_tensors`), which their
  patched loader hands to `LoRAModel.from_lora_tensors(lora_model_id, tensors, peft_helper=
  PEFTHelper.from_dict(peft_config), ...)` (vllm/lora/lora_model.py, vllm/lora/peft_helper.py).
  Refused in one line, as vLLM refuses them: `modules_to_save` (`PEFTHelper._validate_features`) and a
  3D-MoE layer with only one of gate_up / down adapted (`_stack_moe_lora_weights` asserts both).

DoRA (`use_dora`): neither engine serves it, each refused in one line naming it. vLLM's `PEFTHelper.
_validate_features` rejects `use_dora` ("vLLM does not yet support DoRA"; DoRA serving is an open PR, vllm-project/vllm
47395); SGLang's LoRA layers (python/sglang/srt/lora/layers.py) add `scaling * B A x` to the base output and read no
`lora_magnitude_vector`, so a DoRA adapter would roll out another policy. Merged weights (`merge_adapters`) serve.

DeepSeek-V3 (`deepseek_v3`, multi-latent attention), what each engine applies LoRA to, from its source:
- SGLang: every MLA projection. `q_a_proj` and `kv_a_proj_with_mqa` through its fused
  `fused_qkv_a_proj_with_mqa` (sgl-project/sglang PR 22323), `q_b_proj` and `kv_b_proj` since PR 25001
  (python/sglang/srt/models/deepseek_v2.py, python/sglang/srt/lora/: the `kv_b_proj` delta is added to both
  absorbed-MLA matmuls by hand, since the absorbed path never calls `kv_b_proj.forward`); passed.
- vLLM: `DeepseekV2ForCausalLM` is `SupportsLoRA` (vllm/model_executor/models/deepseek_v2.py; `q_a_proj` and
  `kv_a_proj_with_mqa` packed as `fused_qkv_a_proj`), but an adapter on `kv_b_proj` loads and is applied nowhere:
  decode multiplies by `W_UK` / `W_UV` split from the base weight at load time, prefill calls a `kv_b_proj`
  reference the attention implementation took before LoRA wrapped the layer
  (vllm/model_executor/layers/attention/mla_attention.py, vllm/lora/model_manager.py; vllm-project/vllm
  issue 48974). Refused in one line (silently dropping a trained delta would roll out another policy).

Per-module ranks and alphas (`rank_pattern` / `alpha_pattern`: SGLang and vLLM 0214369's PEFTHelper read one
r and alpha per adapter; a later PEFTHelper's `get_rank_and_scaling` reads the patterns) reach them through
`one_rank`: every module padded with zeros to the largest rank and its own scaling folded into its lora_B,
so a single `lora_alpha / r` gives each module its delta, whichever reading the engine has.

docs/handoff.md section 3.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict

import torch

from megatron_lora_patch.handoff.state import AdapterState
from megatron_lora_patch.lora.config_rules import scaling
from megatron_lora_patch.lora.exchange.checks import peft_pattern_value
from megatron_lora_patch.lora.exchange.names import PEFT_PREFIX, PeftFormatError

_EXPERTS = re.compile(r"^(.+\.mlp\.experts)(\.base_layer)?\.lora_A\.weight$")
_VLLM_UNAPPLIED = re.compile(r"^.+\.self_attn\.kv_b_proj\.lora_A\.weight$")  # MLA's absorbed up projection


class EngineError(PeftFormatError):
    """The adapter is not one the named engine loads; one-line message."""


def _tensors(state: AdapterState) -> Dict[str, Any]:
    if not state.tensors:
        raise EngineError("the adapter state holds no tensors on this rank; build the payload on the rank "
                          "adapter_state gathered to (its dst)")
    return dict(state.tensors)


def _patterned(config: dict) -> bool:
    return bool(config.get("rank_pattern") or config.get("alpha_pattern"))


def one_rank(state: AdapterState) -> AdapterState:
    """`state` at one r and scaling for engines that read one `r` and `lora_alpha` per adapter: each module's A
    padded with zero rows and B with zero columns to the largest rank, B times the module's own scaling; then
    `r` = `lora_alpha` = that rank (scaling 1), no patterns, no rsLoRA. Each delta `B @ A` is unchanged."""
    config, suffix = state.config, ".lora_A.weight"
    if any(_EXPERTS.match(key) for key in state.tensors):
        raise EngineError("rank_pattern / alpha_pattern on peft's packed experts cannot be folded per expert here; "
                          "pass handoff.convert(state, 'per_expert')")
    paths = [key[len(PEFT_PREFIX) : -len(suffix)] for key in state.tensors if key.endswith(suffix)]
    ranks = {path: int(peft_pattern_value(config.get("rank_pattern") or {}, path, config["r"])) for path in paths}
    top = max(ranks.values())
    tensors = dict(state.tensors)
    for path, rank in ranks.items():
        lora_a, lora_b = (state.tensors[f"{PEFT_PREFIX}{path}.lora_{factor}.weight"] for factor in "AB")
        if lora_a.shape[0] != rank:
            raise EngineError(f"the config's rank_pattern gives {path} r={rank} but its lora_A has rank "
                              f"{lora_a.shape[0]}; export the adapter again")
        alpha = peft_pattern_value(config.get("alpha_pattern") or {}, path, config["lora_alpha"])
        scaled = lora_b * scaling(alpha, rank, bool(config.get("use_rslora")))
        tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = torch.nn.functional.pad(lora_a, (0, 0, 0, top - rank))
        tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = torch.nn.functional.pad(scaled, (0, top - rank))
    flat = {**config, "r": top, "lora_alpha": float(top), "rank_pattern": {}, "alpha_pattern": {}, "use_rslora": False}
    return dataclasses.replace(state, config=flat, tensors=tensors)


def _refuse_dora(state: AdapterState, engine: str, why: str) -> None:
    if state.config.get("use_dora"):
        raise EngineError(f"{engine} cannot serve DoRA adapters (use_dora=true: {why}); roll out merged weights "
                          "(merge_adapters) or train with MEGATRON_LORA_DORA=0")


def sglang_payload(state: AdapterState, lora_name: str) -> Dict[str, Any]:
    """Keyword arguments of SGLang's `Engine.load_lora_adapter_from_tensors` for `state` on rank `dst`."""
    _tensors(state)
    _refuse_dora(state, "SGLang", "its LoRA layers apply no lora_magnitude_vector")
    if state.config.get("target_parameters"):
        raise EngineError("SGLang reads routed experts per expert (`experts.<e>.` names) or as 3D tensors, not peft's "
                          "packed target_parameters wrappers; pass handoff.convert(state, 'per_expert')")
    if _patterned(state.config) or state.config.get("use_rslora"):
        state = one_rank(state)
    return {"lora_name": lora_name, "tensors": _tensors(state), "config_dict": dict(state.config)}


def _check_vllm(state: AdapterState) -> None:
    config = state.config
    if config.get("modules_to_save"):
        raise EngineError(f"vLLM loads no modules_to_save ({config['modules_to_save']}); train without "
                          "MEGATRON_LORA_MODULES_TO_SAVE or roll out with SGLang / merged weights")
    unapplied = sorted(key[len(PEFT_PREFIX) : -len(".lora_A.weight")] for key in state.tensors
                       if _VLLM_UNAPPLIED.match(key))
    if unapplied:
        raise EngineError(f"vLLM loads but never applies LoRA on MLA's kv_b_proj ({unapplied[0]}: absorbed into "
                          "W_UK / W_UV, vLLM issue 48974); train with MEGATRON_LORA_EXCLUDE=linear_kv_up_proj, or "
                          "roll out with SGLang")
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
    _tensors(state)
    _refuse_dora(state, "vLLM", "PEFTHelper rejects it")
    _check_vllm(state)
    if _patterned(state.config):
        state = one_rank(state)
    tensors = _tensors(state)
    return {"lora_name": lora_name, "lora_int_id": lora_int_id, "lora_path": lora_name,
            "peft_config": dict(state.config), "lora_tensors": tensors}
