"""Engine payloads and server MoE layouts of the in-memory hand-off, read the way the engines read them.

A TP2 dense model (Llama) and an EP2 MoE model (Qwen3-MoE, experts as peft `target_parameters`) take
`adapter_state`; the SGLang and vLLM payloads (`handoff.sglang_payload` / `vllm_payload`; SGLang's of the
`per_expert` layout for MoE, the expert layout its memory pool reads) and the `per_expert` layout
(`handoff.convert`) are merged into the `transformers` model by `engine_loaders`, a
reader written from each engine's loader source (names, shapes, orientation, scaling). Logits must equal
Megatron's (fp32, 1e-5 of the largest logit). Negative controls > 100x off: vLLM's 3D expert B read
expert-major instead of expert-minor; the dense adapter scaled as rsLoRA. SGLang has no rsLoRA: an rsLoRA
state's payload (scaling folded into B, `engines.one_rank`) read as SGLang equals PEFT's reading of the state.
Refusals are one line each.
"""

from __future__ import annotations

import dataclasses

import engine_loaders
import handoff_worker
import persistence_worker
import pytest
import torch
from error_metrics import max_abs_error_over_max

from megatron_lora_patch import handoff
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import DEFAULT_SEED, TinyGPTSpec
from megatron_lora_patch.runtime.errors import UsageError

LOGITS_TOLERANCE = 1e-5
SEED = 41
MOE = dataclasses.replace(TinyGPTSpec.moe(moe_ffn_hidden_size=32), qk_layernorm=True)
CASES = {"tp2-llama": ("tp2", TinyGPTSpec(), "llama"), "ep2-qwen3_moe": ("ep2", MOE, "qwen3_moe")}


@pytest.fixture(scope="module", params=list(CASES))
def handed(request, tmp_path_factory):
    topology, spec, family = CASES[request.param]
    root = tmp_path_factory.mktemp(f"engines-{request.param}")
    rank = run_world(handoff_worker.state_world, 2, args=(topology, spec, SEED, str(root / "ckpt"), family),
                     name=topology, timeout=300)[0]
    state = handoff.AdapterState(rank["config"], rank["tensors"], family)
    return {"state": state, "logits": rank["logits"], "spec": spec}


def _hf(handed):
    import hf_llama

    build = hf_llama.llama_for if handed["state"].family == "llama" else hf_llama.qwen3_moe_for
    return build(handed["spec"], DEFAULT_SEED)


def _logits(handed, tensors: dict, config: dict, read=engine_loaders.merge, **reader) -> torch.Tensor:
    model = read(_hf(handed), tensors, config, **reader)
    with torch.no_grad():
        return model(persistence_worker.batch(handed["spec"])[0]).logits


def _error(handed, tensors: dict, config: dict, read=engine_loaders.merge, **reader) -> float:
    return max_abs_error_over_max(_logits(handed, tensors, config, read, **reader), handed["logits"])


def test_vllm_payload_read_as_vllm_gives_megatron_logits(handed):
    payload = handoff.vllm_payload(handed["state"], "policy", 1)
    assert set(payload) == {"lora_name", "lora_int_id", "lora_path", "peft_config", "lora_tensors"}
    error = _error(handed, payload["lora_tensors"], payload["peft_config"], engine_loaders.vllm_merge)
    print(f"vLLM reader ({handed['state'].family}): {error:.3e}")
    assert error <= LOGITS_TOLERANCE
    if handed["state"].family == "llama":
        control = _error(handed, payload["lora_tensors"], {**payload["peft_config"], "use_rslora": True})
    else:
        control = _error(handed, payload["lora_tensors"], payload["peft_config"], expert_minor=False)
    print(f"control: {control:.3e}")
    assert control > 100 * LOGITS_TOLERANCE


def test_sglang_payload_read_as_sglang_gives_megatron_logits(handed):
    state = handed["state"]
    if state.family != "llama":  # SGLang reads experts per expert (engines.py), not the packed wrappers
        state = handoff.convert(state, "per_expert")
    payload = handoff.sglang_payload(state, "policy")
    assert set(payload) == {"lora_name", "tensors", "config_dict"}
    assert all(name.startswith(engine_loaders.PREFIX) for name in payload["tensors"])
    error = _error(handed, payload["tensors"], payload["config_dict"], engine_loaders.sglang_merge)
    print(f"SGLang reader ({state.family}): {error:.3e}")
    assert error <= LOGITS_TOLERANCE
    rslora = dataclasses.replace(state, config={**state.config, "use_rslora": True})  # SGLang has no rsLoRA: folded
    folded = handoff.sglang_payload(rslora, "policy")
    assert not folded["config_dict"]["use_rslora"]
    peft_reading = _logits(handed, rslora.tensors, rslora.config)
    error = max_abs_error_over_max(_logits(handed, folded["tensors"], folded["config_dict"],
                                           engine_loaders.sglang_merge), peft_reading)
    print(f"SGLang reader, rsLoRA folded into B, vs PEFT's reading: {error:.3e}")
    assert error <= LOGITS_TOLERANCE < 100 * LOGITS_TOLERANCE < max_abs_error_over_max(peft_reading, handed["logits"])


def test_per_expert_layout_gives_megatron_logits(handed):
    state = handed["state"]
    assert handoff.convert(state, "peft") is state
    if state.family == "llama":  # a dense family: no engine has per-expert modules for it
        with pytest.raises(handoff.LayoutError):
            handoff.convert(state, "per_expert")
        return
    converted = handoff.convert(state, "per_expert")
    assert "target_parameters" not in converted.config
    assert converted.tensors["base_model.model.model.layers.1.mlp.experts.3.up_proj.lora_B.weight"].shape == (32, 4)
    error = _error(handed, converted.tensors, converted.config)
    print(f"per-expert reader: {error:.3e}")
    assert error <= LOGITS_TOLERANCE


def test_refusals_are_one_line(handed):
    state = handed["state"]
    saving = dataclasses.replace(state, config={**state.config, "modules_to_save": ["lm_head"]})
    patterned = dataclasses.replace(state, config={**state.config, "rank_pattern": {"o_proj": 2}})
    for call, text in (
        (lambda: handoff.convert(state, "shared_outer"),
         "no engine loads" if state.family == "llama" else "this adapter was trained with one per expert"),
        (lambda: handoff.convert(dataclasses.replace(state, family="llama"), "per_expert"), "no engine loads"),
        (lambda: handoff.vllm_payload(saving, "p", 1), "vLLM loads no modules_to_save"),
        (lambda: handoff.vllm_payload(patterned, "p", 1), "rank_pattern"),
        (lambda: handoff.sglang_payload(dataclasses.replace(state, tensors={}), "p"), "no tensors on this rank"),
        (lambda: handoff.adapter_state([], dst=1), "dst=1 is not a rank of this world of 1"),
    ):
        with pytest.raises(UsageError) as error:
            call()
        assert text in str(error.value) and "\n" not in str(error.value)
