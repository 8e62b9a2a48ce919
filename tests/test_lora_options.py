"""rsLoRA and per-module rank / alpha (issue 19): parsing, one-line errors, the scale of each module,
the model build refusing pattern entries that match no adapted layer, and PEFT import refusing
what the model's adapters are not (pure conversions; the PEFT round trip is test_persistence_peft).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import assert_one_line_error, run_fresh
from test_fail_closed_lora import BUILD
from test_persistence_peft_errors import DESCRIPTION, SHAPES

from megatron_lora_patch.lora.config import LoraConfig, LoraConfigError
from megatron_lora_patch.lora.exchange import peft
from megatron_lora_patch.lora.exchange.names import PeftFormatError

FC1 = "decoder.layers.1.mlp.linear_fc1"
EXPERT_FC1 = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1"


def test_environment_and_config_file_give_the_same_settings(tmp_path):
    env = LoraConfig.from_env(
        {
            "MEGATRON_LORA_RSLORA": "true",
            "MEGATRON_LORA_RANK_PATTERN": "*local_experts*=4, linear_fc1=8",
            "MEGATRON_LORA_ALPHA_PATTERN": "linear_proj=2",
        }
    )
    path = tmp_path / "lora.toml"
    path.write_text(
        'rslora = true\nrank_pattern = {"*local_experts*" = 4, linear_fc1 = 8}\nalpha_pattern = {linear_proj = 2}\n'
    )
    settings = {
        "rslora": True,
        "rank_pattern": {"*local_experts*": 4, "linear_fc1": 8},
        "alpha_pattern": {"linear_proj": 2},
    }
    json_path = tmp_path / "lora.json"
    json_path.write_text(json.dumps(settings))
    from_code = LoraConfig(**settings)
    assert env.rank_pattern == (("*local_experts*", 4), ("linear_fc1", 8)) and env.alpha_pattern == (
        ("linear_proj", 2.0),
    )
    for source in (path, json_path):
        assert LoraConfig.from_env({"MEGATRON_LORA_CONFIG": str(source)}) == env
    assert from_code == env and LoraConfig.from_description(env.description()) == env


def test_each_module_gets_its_rank_alpha_and_scale():
    config = LoraConfig(
        rank=16, alpha=32.0, rank_pattern={"*local_experts*": 4, "linear_fc1": 8}, alpha_pattern={"linear_fc1": 2}
    )
    assert (config.rank_for(FC1), config.alpha_for(FC1), config.scale_for(FC1)) == (8, 2.0, 0.25)
    assert config.rank_for(EXPERT_FC1) == 4  # the first matching entry wins, as in PEFT
    assert config.scale_for("decoder.layers.0.self_attention.linear_qkv") == config.scale == 2.0
    rs = LoraConfig(rank=16, alpha=32.0, rslora=True, rank_pattern={"linear_fc1": 4})
    assert rs.scale == 32.0 / 4 and rs.scale_for(FC1) == 32.0 / 2
    assert rs.scale_for(FC1) != LoraConfig(rank=16, alpha=32.0, rank_pattern={"linear_fc1": 4}).scale_for(FC1)


RANK_SYNTAX = (
    "comma-separated pattern=rank entries (positive integer ranks, each pattern once), e.g. 'linear_fc1=8,linear_fc2=8'"
)
ALPHA_SYNTAX = "comma-separated pattern=alpha entries (positive numbers, each pattern once), e.g. 'linear_fc1=16'"
BAD = [
    ("MEGATRON_LORA_RSLORA", "maybe", "one of 1, true, yes, on, 0, false, no, off"),
    ("MEGATRON_LORA_RANK_PATTERN", "linear_fc1", RANK_SYNTAX),
    ("MEGATRON_LORA_RANK_PATTERN", "linear_fc1=0", None),
    ("MEGATRON_LORA_RANK_PATTERN", "linear_fc1=2.5", None),
    ("MEGATRON_LORA_RANK_PATTERN", "=4", None),
    ("MEGATRON_LORA_RANK_PATTERN", "linear_fc1=2,linear_fc1=4", None),
    ("MEGATRON_LORA_ALPHA_PATTERN", "linear_fc1=inf", ALPHA_SYNTAX),
    ("MEGATRON_LORA_ALPHA_PATTERN", "linear_fc1=-2", None),
]


@pytest.mark.parametrize("variable, value, requirement", BAD, ids=[f"{v}={x}" for v, x, _ in BAD])
def test_bad_values_fail_with_one_line(variable, value, requirement):
    requirement = requirement or next(r for v, _, r in BAD if v == variable and r)
    with pytest.raises(LoraConfigError) as raised:
        LoraConfig.from_env({variable: value})
    assert str(raised.value) == f"{variable} must be {requirement}, got {value!r}"


def test_bad_values_from_code_and_files_fail():
    with pytest.raises(LoraConfigError, match="LoraConfig.rank_pattern must be"):
        LoraConfig(rank_pattern={"linear_fc1": "8"})
    with pytest.raises(LoraConfigError, match="LoraConfig.rslora must be true or false, got 1"):
        LoraConfig(rslora=1)  # typed: 1 is not a boolean (as text, "1" is)


# -- the model build: pattern entries must match an adapted layer ------------------------------

ADAPTED = (
    "adapted layers: linear_proj, linear_qkv, linear_fc1, linear_fc2 (or fnmatch globs over qualified "
    "names such as 'decoder.layers.0.self_attention.linear_proj')"
)
BUILD_ERRORS = {
    "rank_pattern_typo": (
        {"MEGATRON_LORA_RANK_PATTERN": "linear_fc3=2"},
        "MEGATRON_LORA_RANK_PATTERN entry 'linear_fc3' matches no adapted layer of the model "
        f"(did you mean 'linear_fc2'?); {ADAPTED}",
    ),
    "alpha_pattern_not_targeted": (
        {"MEGATRON_LORA_TARGETS": "linear_qkv", "MEGATRON_LORA_ALPHA_PATTERN": "linear_fc1=2"},
        "MEGATRON_LORA_ALPHA_PATTERN entry 'linear_fc1' matches no adapted layer of the model (did you mean "
        "'linear_qkv'?); adapted layers: "
        "linear_qkv (or fnmatch globs over qualified names such as 'decoder.layers.0.self_attention.linear_qkv')",
    ),
    "rank_per_layer": (
        {"MEGATRON_LORA_RANK_PATTERN": "decoder.layers.0.*=2"},
        "MEGATRON_LORA_RANK_PATTERN gives decoder.layers.0.mlp.linear_fc1 rank 2 but decoder.layers.1.mlp.linear_fc1 "
        "rank 16; ranks may differ between module kinds, not between layers or experts of one kind (adapter "
        "checkpoints stack them); use patterns without layer or expert indices",
    ),
    "pattern_rank_too_large": (
        {"MEGATRON_LORA_RANK_PATTERN": "linear_proj=65"},
        "LoRA rank 65 exceeds decoder.layers.0.self_attention.linear_proj (in 64, out 64); "
        "set MEGATRON_LORA_RANK_PATTERN <= 64",
    ),
}


@pytest.mark.parametrize("case", BUILD_ERRORS)
def test_bad_patterns_stop_the_model_build(case):
    env, message = BUILD_ERRORS[case]
    assert_one_line_error(run_fresh(["-c", BUILD], MEGATRON_PLUGINS="lora_correct", **env), message)


def test_good_patterns_build_adapters_of_those_ranks_and_scales():
    """The positive control: the same script, patterns that match, adapters of the asked rank and scale."""
    listing = (
        'sorted({(n.rsplit(".", 2)[-2], m.rank, m.scale) for n, m in model.named_modules() if n.endswith(".lora")})'
    )
    script = BUILD.replace('print("adapted:"', f'print("ranks:", {listing})\n    print("adapted:"')
    env = {
        "MEGATRON_LORA_RANK_PATTERN": "linear_fc1=2,linear_fc2=2",
        "MEGATRON_LORA_ALPHA_PATTERN": "linear_proj=4",
        "MEGATRON_LORA_RSLORA": "1",
    }
    result = run_fresh(["-c", script], MEGATRON_PLUGINS="lora_correct", **env)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("ranks:"))
    fc_scale = 32 / math.sqrt(2)  # rsLoRA: alpha / sqrt(r)
    expected = sorted(
        {("linear_fc1", 2, fc_scale), ("linear_fc2", 2, fc_scale), ("linear_proj", 16, 1.0), ("linear_qkv", 16, 8.0)}
    )
    assert line == f"ranks: {expected}"


# -- PEFT import: the adapter's rsLoRA and per-module r / alpha must be the model's ---------------

PATTERNED = {
    **DESCRIPTION,
    "rslora": True,
    "rank_pattern": [["linear_fc2", 2]],
    "alpha_pattern": [["linear_proj", 4.0]],
}


def _logical(description):
    settings = LoraConfig.from_description(description)
    generator = torch.Generator().manual_seed(5)
    result = {}
    for name, (a, b) in SHAPES.items():
        rank = settings.rank_for(name)
        result[name] = (torch.randn((rank, a[1]), generator=generator), torch.randn((b[0], rank), generator=generator))
    return result


def _import(tensors, config, description=PATTERNED):
    return peft.from_peft(tensors, config, description, SHAPES, where="adapter")


def _refused(config, *fragments, tensors=None, description=PATTERNED):
    tensors = tensors if tensors is not None else peft.to_peft(_logical(PATTERNED), PATTERNED)[0]
    with pytest.raises(PeftFormatError) as caught:
        _import(tensors, config, description)
    message = str(caught.value)
    assert "\n" not in message and all(fragment in message for fragment in fragments), message


def test_patterned_adapter_exports_peft_fields_and_round_trips():
    logical = _logical(PATTERNED)
    tensors, config = peft.to_peft(logical, PATTERNED)
    assert (config["use_rslora"], config["rank_pattern"], config["alpha_pattern"]) == (
        True,
        {"down_proj": 2},
        {"o_proj": 4.0},
    )
    restored = _import(tensors, config)
    assert all(torch.equal(restored[n][i], logical[n][i]) for n in logical for i in (0, 1))


def test_two_layers_with_different_alphas_are_keyed_by_full_path():
    two = {**PATTERNED, "num_layers": 2, "alpha_pattern": [["decoder.layers.1.*", 3.0]]}
    logical = {
        name.replace("layers.0", f"layers.{layer}"): pair for name, pair in _logical(two).items() for layer in (0, 1)
    }
    _, config = peft.to_peft(logical, two)
    assert config["alpha_pattern"] == {
        f"model.layers.1.{p}": 3.0
        for p in (
            "mlp.down_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "self_attn.k_proj",
            "self_attn.o_proj",
            "self_attn.q_proj",
            "self_attn.v_proj",
        )
    }


def test_other_rslora_rank_or_alpha_patterns_are_refused():
    _, config = peft.to_peft(_logical(PATTERNED), PATTERNED)
    _refused({**config, "use_rslora": False}, "use_rslora=false", "MEGATRON_LORA_RSLORA=0")
    _refused(
        {**config, "alpha_pattern": {}},
        "lora_alpha=8.0 for model.layers.0.self_attn.o_proj",
        "alpha 4.0",
        "MEGATRON_LORA_ALPHA=8.0",
    )
    _refused({**config, "alpha_pattern": {"o_proj": 5}}, "lora_alpha=5", "MEGATRON_LORA_ALPHA_PATTERN")
    # without the pattern the config's r no longer describes the rank-2 tensors: that mismatch is named (issue 26)
    _refused({**config, "rank_pattern": {}}, "gives model.layers.0.mlp.down_proj r=4", "lora_A has rank 2")
    _refused({**config, "alpha_pattern": {**config["alpha_pattern"], "k_proj": 2}}, "lora_alpha", "fused Megatron")
    _refused({**config, "rank_pattern": {"down_proj": "2"}}, "rank_pattern must map module patterns to numbers")
    _refused({**config, "alpha_pattern": {"(": 2}}, "not a valid regex")
