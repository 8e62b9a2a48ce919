"""LoRA configuration: defaults, precedence, and one exact line per bad value."""

from __future__ import annotations

import json

import pytest

from megatron_lora_patch.lora.config import DEFAULT_TARGETS, LoraConfig, LoraConfigError
from megatron_lora_patch.runtime.errors import UsageError


def test_defaults_and_scale():
    config = LoraConfig.from_env({})
    assert config == LoraConfig()
    assert config.targets == DEFAULT_TARGETS == (
        "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
        "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
    )
    assert config.sp_input == "keep" and config.b_init == "zero" and config.init == "kaiming"
    assert LoraConfig(rank=8, alpha=4.0).scale == 0.5


def test_environment_values_are_parsed():
    config = LoraConfig.from_env(
        {
            "MEGATRON_LORA_RANK": "4",
            "MEGATRON_LORA_ALPHA": "8",
            "MEGATRON_LORA_DROPOUT": "0.1",
            "MEGATRON_LORA_TARGETS": "linear_qkv, decoder.layers.1.*",
            "MEGATRON_LORA_EXCLUDE": "decoder.layers.0.*",
            "MEGATRON_LORA_INIT": "gaussian",
            "MEGATRON_LORA_B_INIT": "nonzero",
            "MEGATRON_LORA_SEED": "7",
            "MEGATRON_LORA_SP_INPUT": "regather",
            "MEGATRON_LORA_PLUS_RATIO": "16",
            "MEGATRON_LORA_DORA": "1",
        }
    )
    assert config == LoraConfig(
        rank=4,
        alpha=8.0,
        dropout=0.1,
        targets=("linear_qkv", "decoder.layers.1.*"),
        exclude=("decoder.layers.0.*",),
        init="gaussian",
        b_init="nonzero",
        seed=7,
        sp_input="regather",
        plus_ratio=16.0,
        dora=True,
    )


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_config_file_then_variables_override_it(tmp_path, suffix):
    path = tmp_path / f"lora{suffix}"
    if suffix == ".toml":
        path.write_text('rank = 4\nalpha = 2\ntargets = ["linear_proj"]\ninit = "gaussian"\nplus_ratio = 8\n')
    else:
        path.write_text(json.dumps({"rank": 4, "alpha": 2, "targets": ["linear_proj"], "init": "gaussian",
                                    "plus_ratio": 8}))
    config = LoraConfig.from_env({"MEGATRON_LORA_CONFIG": str(path), "MEGATRON_LORA_RANK": "2"})
    assert config == LoraConfig(rank=2, alpha=2.0, targets=("linear_proj",), init="gaussian", plus_ratio=8.0)
    assert isinstance(config.plus_ratio, float)


PLUS_RATIO_RULE = "a positive finite number (B's learning rate / A's; 1: plain LoRA)"
BAD_VARIABLES = [
    ("MEGATRON_LORA_RANK", "abc", "MEGATRON_LORA_RANK must be a positive integer, got 'abc'"),
    ("MEGATRON_LORA_RANK", "0", "MEGATRON_LORA_RANK must be a positive integer, got '0'"),
    ("MEGATRON_LORA_RANK", "2.5", "MEGATRON_LORA_RANK must be a positive integer, got '2.5'"),
    ("MEGATRON_LORA_ALPHA", "-1", "MEGATRON_LORA_ALPHA must be a positive finite number, got '-1'"),
    ("MEGATRON_LORA_ALPHA", "inf", "MEGATRON_LORA_ALPHA must be a positive finite number, got 'inf'"),
    ("MEGATRON_LORA_DROPOUT", "1", "MEGATRON_LORA_DROPOUT must be a number in [0, 1), got '1'"),
    ("MEGATRON_LORA_DROPOUT", "x", "MEGATRON_LORA_DROPOUT must be a number in [0, 1), got 'x'"),
    (
        "MEGATRON_LORA_TARGETS",
        " , ",
        "MEGATRON_LORA_TARGETS must be a non-empty comma-separated list of module names or glob patterns, got ' , '",
    ),
    ("MEGATRON_LORA_INIT", "xavier", "MEGATRON_LORA_INIT must be one of kaiming, gaussian, got 'xavier'"),
    ("MEGATRON_LORA_B_INIT", "ones", "MEGATRON_LORA_B_INIT must be one of zero, nonzero, got 'ones'"),
    ("MEGATRON_LORA_SEED", "-3", "MEGATRON_LORA_SEED must be a non-negative integer, got '-3'"),
    ("MEGATRON_LORA_SP_INPUT", "gather", "MEGATRON_LORA_SP_INPUT must be one of keep, regather, got 'gather'"),
    ("MEGATRON_LORA_PLUS_RATIO", "0", f"MEGATRON_LORA_PLUS_RATIO must be {PLUS_RATIO_RULE}, got '0'"),
    ("MEGATRON_LORA_PLUS_RATIO", "nan", f"MEGATRON_LORA_PLUS_RATIO must be {PLUS_RATIO_RULE}, got 'nan'"),
    ("MEGATRON_LORA_PLUS_RATIO", "x16", f"MEGATRON_LORA_PLUS_RATIO must be {PLUS_RATIO_RULE}, got 'x16'"),
]


@pytest.mark.parametrize("variable, value, message", BAD_VARIABLES)
def test_bad_variable_fails_with_one_line(variable, value, message):
    with pytest.raises(LoraConfigError) as raised:
        LoraConfig.from_env({variable: value})
    assert str(raised.value) == message
    assert isinstance(raised.value, UsageError)  # printed as one line, no traceback


def test_empty_or_blank_variable_means_unset(tmp_path):
    """As for the runtime's flags: `MEGATRON_LORA_RANK=` is the default, not an error."""
    environ = {"MEGATRON_LORA_RANK": "", "MEGATRON_LORA_TARGETS": "  ", "MEGATRON_LORA_CONFIG": " "}
    assert LoraConfig.from_env(environ) == LoraConfig()
    path = tmp_path / "lora.json"
    path.write_text('{"rank": 4}')
    assert LoraConfig.from_env({"MEGATRON_LORA_CONFIG": str(path), "MEGATRON_LORA_RANK": ""}).rank == 4


def test_bad_config_files(tmp_path):
    yaml = tmp_path / "lora.yaml"
    with pytest.raises(LoraConfigError) as raised:
        LoraConfig.from_env({"MEGATRON_LORA_CONFIG": str(yaml)})
    assert str(raised.value) == f"MEGATRON_LORA_CONFIG must name a .toml or .json file, got '{yaml}'"

    missing = tmp_path / "missing.json"
    with pytest.raises(LoraConfigError) as raised:
        LoraConfig.from_env({"MEGATRON_LORA_CONFIG": str(missing)})
    assert str(raised.value) == f"MEGATRON_LORA_CONFIG ({missing}): cannot read the file: No such file or directory"

    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"rnak": 4}')
    with pytest.raises(LoraConfigError) as raised:
        LoraConfig.from_env({"MEGATRON_LORA_CONFIG": str(unknown)})
    assert str(raised.value) == (
        f"MEGATRON_LORA_CONFIG ({unknown}): unknown key 'rnak' (did you mean 'rank'?); accepted keys: "
        "rank, alpha, dropout, targets, exclude, init, b_init, seed, sp_input, rslora, rank_pattern, alpha_pattern, "
        "separate_projections, expert_shared_outer, modules_to_save, plus_ratio, dora"
    )

    typed = tmp_path / "typed.toml"
    typed.write_text("rank = -2\n")
    with pytest.raises(LoraConfigError) as raised:
        LoraConfig.from_env({"MEGATRON_LORA_CONFIG": str(typed)})
    assert str(raised.value) == f"rank in {typed} must be a positive integer, got -2"

    listed = tmp_path / "listed.json"
    listed.write_text('{"rank": [4]}')
    with pytest.raises(LoraConfigError) as raised:
        LoraConfig.from_env({"MEGATRON_LORA_CONFIG": str(listed)})
    assert str(raised.value) == f"rank in {listed} must be a positive integer, got [4]"  # as written

    broken = tmp_path / "broken.json"
    broken.write_text("{rank: 4")
    with pytest.raises(LoraConfigError) as raised:
        LoraConfig.from_env({"MEGATRON_LORA_CONFIG": str(broken)})
    assert str(raised.value).startswith(f"MEGATRON_LORA_CONFIG ({broken}): invalid JSON: ")
    assert "\n" not in str(raised.value)


def test_dataclass_validates_programmatic_values():
    with pytest.raises(LoraConfigError) as raised:
        LoraConfig(rank=True)
    assert str(raised.value) == "LoraConfig.rank must be a positive integer, got True"
    with pytest.raises(LoraConfigError) as raised:
        LoraConfig(targets=("linear_qkv,linear_proj",))
    assert str(raised.value) == (
        "LoraConfig.targets must be a non-empty comma-separated list of module names or glob patterns, "
        "got ('linear_qkv,linear_proj',)"
    )
