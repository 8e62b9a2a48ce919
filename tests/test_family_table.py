"""One record per Hugging Face family (lora/exchange/family_table.py): every reader derives from the table.

A made-up MoE family with names of its own, added to `FAMILIES` alone, is seen by the family check
(`families.resolve`), the export / import names (`names_for`, experts, shared experts), the hand-off's
per-expert layout (`handoff.convert`) and `export --help`; nothing else needs a row. `--help` imports no torch.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from megatron_lora_patch.handoff import AdapterState, convert
from megatron_lora_patch.lora.exchange import experts, families, family_table, mlp
from megatron_lora_patch.lora.exchange.names import PeftFormatError, family_record, names_for

LLAMA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "gated_linear_unit": True, "activation": "silu",
         "qk_layernorm": False, "add_bias_linear": False, "add_qkv_bias": False, "num_experts": 0}
TOY = family_table.Family(
    qk_layernorm=True, biases="none",
    names=family_table.HfNames(layers="model.blocks", shared_experts="mlp.common_expert"),
    experts=family_table.ExpertNames(experts="mlp.experts", linear_fc2="w_out"),
    per_expert=family_table.PerExpertNames("moe.experts", "w_gate", "w_up", "w_down"),
)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(family_table.FAMILIES, "toy_moe", TOY)
    return TOY


def _export_help() -> str:
    from megatron_lora_patch.cli import export

    commands = argparse.ArgumentParser().add_subparsers()
    export.add_parser(commands)
    return next(action.help for action in commands.choices["export"]._actions if "--family" in action.option_strings)


def test_every_family_has_names_and_rules():
    assert list(families.FAMILIES) == list(family_table.FAMILIES)
    assert all(not families.mismatches({**LLAMA, "qk_layernorm": f.qk_layernorm, "num_experts": 4 * f.moe,
                                        "multi_latent_attention": f.names.mla is not None}, name)
               for name, f in family_table.FAMILIES.items())
    moe = ["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3"]
    assert family_table.with_experts() == family_table.with_per_expert() == moe
    assert family_table.with_shared_experts() == ["qwen2_moe", "deepseek_v3"] and family_table.with_mla() == moe[3:]


def test_export_help_lists_the_table():
    listed = _export_help().split("HF model family: ", 1)[1].split(" (", 1)[0]
    assert listed.split(", ") == list(family_table.FAMILIES)


def test_export_help_imports_no_torch():
    code = "import sys, megatron_lora_patch.cli.export; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout == "False\n"


def test_a_new_record_is_read_by_the_family_check_and_the_names(toy):
    assert families.resolve({**LLAMA, "qk_layernorm": True, "num_experts": 4}, "toy_moe") == "toy_moe"
    assert family_record("toy_moe") is toy and names_for("toy_moe") is toy.names
    assert experts._expert_names("toy_moe") is toy.experts
    assert "toy_moe" in _export_help() and "shared experts too: qwen2_moe, deepseek_v3, toy_moe" in _export_help()
    with pytest.raises(PeftFormatError, match="--family qwen3_moe or mixtral or qwen2_moe or deepseek_v3 or toy_moe$"):
        experts._expert_names("llama")
    with pytest.raises(PeftFormatError, match="--family qwen2_moe or deepseek_v3 or toy_moe$"):
        mlp.projections("mlp.shared_experts.linear_fc2", names_for("llama"), gated=True)
    assert mlp.projections("mlp.shared_experts.linear_fc2", toy.names, gated=True) == ["mlp.common_expert.down_proj"]


def test_a_new_record_is_read_by_the_export_of_experts(toy):
    logical = {f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc2": (torch.ones(2, 3), torch.ones(4, 2))
               for e in range(2)}
    description = {"rank": 2, "alpha": 4.0, "num_experts": 2}
    tensors, _ = experts.to_peft(logical, description, "toy_moe")
    assert sorted(tensors) == [f"base_model.model.model.blocks.0.mlp.experts.lora_{f}.weight" for f in "AB"]
    assert experts.target_parameters(["model.blocks.0.mlp.experts.w_out"], "toy_moe", 1) == ["mlp.experts.w_out"]


def test_a_new_record_is_read_by_the_per_expert_layout(toy):
    """The packed input in the record's names (layers `model.blocks`, fc2 `w_out`), per-expert output in its
    per-expert names, its rank pattern re-keyed from the packed parameter's path."""
    wrapper = "base_model.model.model.blocks.0.mlp.experts"
    config = {"r": 1, "lora_alpha": 2, "target_modules": [], "target_parameters": ["mlp.experts.w_out"],
              "rank_pattern": {"model.blocks.0.mlp.experts.w_out": 2}}  # rank 2: one expert
    state = AdapterState(config, {f"{wrapper}.lora_A.weight": torch.ones(2, 3),
                                  f"{wrapper}.lora_B.weight": torch.ones(4, 2)}, "toy_moe")
    converted = convert(state, "per_expert")
    assert sorted(converted.tensors) == [f"base_model.model.model.blocks.0.moe.experts.0.w_down.lora_{f}.weight"
                                         for f in "AB"]
    assert converted.config["rank_pattern"] == {"w_down": 2}  # the packed parameter's pattern, re-keyed
    assert converted.config["target_modules"] == ["w_down", "w_gate", "w_up"]
    with pytest.raises(PeftFormatError, match="is known for qwen3_moe, mixtral, qwen2_moe, deepseek_v3, toy_moe "):
        convert(AdapterState(config, state.tensors, "llama"), "per_expert")
