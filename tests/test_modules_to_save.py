"""Modules trained fully (PEFT's `modules_to_save`, issue 19): parsing from the environment and the config
file, one-line refusals (a module that cannot train fully, tied embeddings, a module both adapted and
trained fully, a PEFT adapter whose modules_to_save differs from the model's), and which weights a built
model trains. The oracle proof is test_oracle_modules_to_save, the PEFT round trip test_persistence_peft_modules.
"""

from __future__ import annotations

import json

import pytest

from conftest import assert_one_line_error, run_fresh
from megatron_lora_patch.lora import peft_modules
from megatron_lora_patch.lora.config import LoraConfig, LoraConfigError
from megatron_lora_patch.lora.peft import PeftFormatError
from test_fail_closed_lora import ACTIVATE, BUILD

SYNTAX = (
    "a comma-separated list of modules to train fully, each matching one of output_layer, embedding.word_embeddings "
    "(a last name such as output_layer or word_embeddings, or a glob)"
)
# Prints every trainable parameter of the built world-1 model.
TRAINABLE = BUILD.replace('print("adapted:"', 'print("trainable:", ",".join(n for n, p in model.named_parameters() '
                          'if p.requires_grad and ".lora." not in n)); print("adapted:"')


def test_environment_config_file_and_code_agree(tmp_path):
    env = LoraConfig.from_env({"MEGATRON_LORA_MODULES_TO_SAVE": "output_layer, word_embeddings"})
    toml = tmp_path / "lora.toml"
    toml.write_text('modules_to_save = ["output_layer", "word_embeddings"]\n')
    from_file = LoraConfig.from_env({"MEGATRON_LORA_CONFIG": str(toml)})
    from_code = LoraConfig(modules_to_save=("output_layer", "word_embeddings"))
    assert env == from_file == from_code and env.modules_to_save == ("output_layer", "word_embeddings")
    assert LoraConfig.from_description(env.description()) == env
    assert LoraConfig.from_description({"rank": 16}).modules_to_save == ()  # an older checkpoint


@pytest.mark.parametrize("value", ["lm_head", "linear_qkv", "decoder.*", "output_layer,embed_tokens"])
def test_a_module_that_cannot_train_fully_stops_activation(value):
    assert_one_line_error(
        run_fresh(["-c", ACTIVATE], MEGATRON_LORA_MODULES_TO_SAVE=value),
        f"MEGATRON_LORA_MODULES_TO_SAVE must be {SYNTAX}, got {value!r}",
    )


def test_a_bad_config_file_entry_names_the_file(tmp_path):
    path = tmp_path / "lora.json"
    path.write_text(json.dumps({"modules_to_save": ["lm_head"]}))
    with pytest.raises(LoraConfigError) as raised:
        LoraConfig.from_env({"MEGATRON_LORA_CONFIG": str(path)})
    assert str(raised.value) == f"modules_to_save in {path} must be {SYNTAX}, got ['lm_head']"


@pytest.mark.parametrize(
    "value, trainable",
    [
        ("output_layer", "output_layer.weight"),
        ("word_embeddings", "embedding.word_embeddings.weight"),
        ("*", "embedding.word_embeddings.weight,output_layer.weight"),
        ("", ""),
    ],
)
def test_only_the_named_weights_stay_trainable(value, trainable):
    result = run_fresh(["-c", TRAINABLE], MEGATRON_PLUGINS="lora_correct", MEGATRON_LORA_MODULES_TO_SAVE=value)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trainable: {trainable}\n" in result.stdout, result.stdout


TIED = BUILD.replace("TinyGPTSpec()", "TinyGPTSpec(tie_embeddings=True)")
BUILD_ERRORS = {
    "tied": (
        TIED,
        {"MEGATRON_LORA_MODULES_TO_SAVE": "output_layer"},
        "MEGATRON_LORA_MODULES_TO_SAVE on a model with tied embeddings is not supported (PEFT would train two "
        "copies of the one shared weight); untie them (--untie-embeddings-and-output-weights) or unset it",
    ),
    "adapted_too": (
        BUILD,
        {"MEGATRON_LORA_MODULES_TO_SAVE": "output_layer", "MEGATRON_LORA_TARGETS": "linear_qkv,output_layer"},
        "output_layer is both a LoRA target and in MEGATRON_LORA_MODULES_TO_SAVE; keep it in one of them",
    ),
}


@pytest.mark.parametrize("case", BUILD_ERRORS)
def test_unsupported_combinations_stop_the_model_build(case):
    script, env, message = BUILD_ERRORS[case]
    assert_one_line_error(run_fresh(["-c", script], MEGATRON_PLUGINS="lora_correct", **env), message)


DESCRIPTION = {"modules_to_save": ["output_layer"]}


def test_peft_modules_to_save_must_be_the_models():
    weight = {"base_model.model.lm_head.weight": object(), "lora": object()}
    rest, full = peft_modules.split(weight, {"modules_to_save": ["lm_head"]}, DESCRIPTION, "dir", PeftFormatError)
    assert set(rest) == {"lora"} and set(full) == {"output_layer"}
    cases = [
        ({"modules_to_save": None}, DESCRIPTION, "dir: modules_to_save=[] but the model trains fully ['lm_head']; "
         "build it with MEGATRON_LORA_MODULES_TO_SAVE unset"),
        ({"modules_to_save": ["lm_head"]}, {}, "dir: modules_to_save=['lm_head'] but the model trains fully []; "
         "build it with MEGATRON_LORA_MODULES_TO_SAVE=output_layer"),
        ({"modules_to_save": ["score"]}, {}, "dir: modules_to_save entry 'score' cannot train fully in Megatron; "
         "supported: lm_head, embed_tokens"),
    ]
    for config, description, message in cases:
        with pytest.raises(PeftFormatError) as raised:
            peft_modules.split(weight, config, description, "dir", PeftFormatError)
        assert str(raised.value) == message
    with pytest.raises(PeftFormatError) as raised:
        peft_modules.split({}, {"modules_to_save": ["lm_head"]}, DESCRIPTION, "dir", PeftFormatError)
    assert str(raised.value) == "dir: missing base_model.model.lm_head.weight (the fully trained Megatron output_layer)"
