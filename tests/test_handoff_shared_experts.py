"""Shared experts (`mlp.shared_experts`, Qwen2-MoE style) through the PEFT format and the in-memory hand-off.

A Megatron MoE model with shared experts (`moe_shared_expert_intermediate_size` 48, sigmoid gate on,
4 routed experts) at TP2 + ETP2 + SP (shared experts TP-sharded, fc1 stride 2) takes `adapter_state
(family="qwen2_moe")` and writes an adapter-only checkpoint. The in-memory state equals the on-disk
export byte for byte; `set_peft_model_state_dict` on a `Qwen2MoeForCausalLM` with the same base weights
gives Megatron's logits (fp32, 1e-5 of the largest logit); negative control: the shared experts'
lora_B zeroed moves them > 100x that. The export imported at EP2 (shared experts whole on each rank)
gives the same adapter state again (round trip). A family without shared experts is refused in one line.
"""

from __future__ import annotations

import os

import handoff_worker
import hf_qwen2_moe
import persistence_worker
import pytest
import torch
from error_metrics import max_abs_error_over_max

from megatron_lora_patch.lora.exchange import files as peft_files
from megatron_lora_patch.lora.exchange import names as peft_names
from megatron_lora_patch.lora.exchange import peft as peft_format
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import DEFAULT_SEED, TinyGPTSpec

SPEC = TinyGPTSpec.moe(moe_ffn_hidden_size=32)
LOGITS_TOLERANCE = 1e-5
SEED = 37
SHARED = ".mlp.shared_expert."


@pytest.fixture(scope="module")
def handed(tmp_path_factory):
    from megatron_lora_patch.lora.exchange.transfer import export_peft

    root = tmp_path_factory.mktemp("handoff-shared")
    checkpoint, export = str(root / "checkpoint"), str(root / "export")
    args = ("tp2-etp2-sp", SPEC, SEED, checkpoint, "qwen2_moe", {}, True)
    ranks = run_world(handoff_worker.state_world, 2, args=args, name="tp2-etp2-sp", timeout=300)
    export_peft(checkpoint, export, "qwen2_moe")
    return {"root": root, "export": export, "ranks": ranks}


def test_shared_experts_export_under_qwen2_moe_names_byte_for_byte(handed):
    state, config = handed["ranks"][0]["tensors"], handed["ranks"][0]["config"]
    shared = sorted(key for key in state if SHARED in key)
    assert len(shared) == SPEC.num_layers * 3 * 2, shared  # gate / up / down, A and B, per layer
    assert state["base_model.model.model.layers.0.mlp.shared_expert.gate_proj.lora_B.weight"].shape == (48, 4)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    peft_files.write(str(handed["root"] / "memory"), state, config, "qwen2_moe")
    for name in (peft_names.WEIGHTS_NAME, peft_names.CONFIG_NAME, peft_names.METADATA_NAME):
        memory = open(os.path.join(handed["root"], "memory", name), "rb").read()
        assert memory == open(os.path.join(handed["export"], name), "rb").read(), name


def _logits(config: dict, tensors: dict) -> torch.Tensor:
    from peft import PeftConfig, get_peft_model, set_peft_model_state_dict

    model = get_peft_model(hf_qwen2_moe.qwen2_moe_for(SPEC, DEFAULT_SEED), PeftConfig.from_peft_type(**config))
    assert not set_peft_model_state_dict(model, tensors).unexpected_keys
    with torch.no_grad():
        return model.eval()(persistence_worker.batch(SPEC)[0]).logits


def test_qwen2_moe_with_the_state_gives_megatron_logits(handed):
    rank = handed["ranks"][0]
    error = max_abs_error_over_max(_logits(rank["config"], rank["tensors"]), rank["logits"])
    print(f"peft (qwen2_moe, shared experts) vs Megatron logits: max-abs / max = {error:.3e}")
    assert error <= LOGITS_TOLERANCE
    unshared = {key: value.zero_() if SHARED in key and ".lora_B." in key else value
                for key, value in ((k, v.clone()) for k, v in rank["tensors"].items())}
    control = max_abs_error_over_max(_logits(rank["config"], unshared), rank["logits"])
    print(f"control, shared experts' lora_B zeroed: {control:.3e}")
    assert control > 100 * LOGITS_TOLERANCE


def test_import_at_ep2_gives_the_same_state(handed):
    args = ("ep2", SPEC, 999, str(handed["root"] / "again"), "qwen2_moe", {}, True, handed["export"])
    again = run_world(handoff_worker.state_world, 2, args=args, name="ep2", timeout=300)[0]["tensors"]
    first = handed["ranks"][0]["tensors"]
    assert list(again) == list(first) and all(torch.equal(again[key], first[key]) for key in first)


def test_a_family_without_shared_experts_is_refused_in_one_line():
    description = {"rank": 4, "alpha": 8.0, "num_layers": 1, "gated_linear_unit": True, "num_experts": 0}
    logical = {"decoder.layers.0.mlp.shared_experts.linear_fc2": (torch.zeros(4, 8), torch.zeros(8, 4))}
    with pytest.raises(peft_names.PeftFormatError) as error:
        peft_format.to_peft(logical, description, "mixtral")
    assert str(error.value) == ("mlp.shared_experts.linear_fc2: this model family has no shared experts; "
                                "use --family qwen2_moe or deepseek_v3")
