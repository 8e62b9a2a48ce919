"""Modules trained fully (PEFT's `modules_to_save`, issue 19): parsing from the environment and the config
file, one-line refusals (a module that cannot train fully, a module both adapted and trained fully, a PEFT
adapter whose modules_to_save differs from the model's or, tied, is not weight-tied), and which weights a
built model trains (tied embeddings: the one shared weight). The oracle proof is test_oracle_modules_to_save, the PEFT
round trip test_persistence_peft_modules.
"""

from __future__ import annotations

import json

import pytest
from conftest import assert_one_line_error, run_fresh
from test_fail_closed_lora import ACTIVATE, BUILD

from megatron_lora_patch.lora.config import LoraConfig, LoraConfigError
from megatron_lora_patch.lora.exchange import modules as peft_modules
from megatron_lora_patch.lora.exchange.names import PeftFormatError

SYNTAX = (
    "a comma-separated list of modules to train fully, each matching one of output_layer, embedding.word_embeddings "
    "(a last name such as output_layer or word_embeddings, or a glob)"
)
# Prints every trainable parameter of the built world-1 model.
TRAINABLE = BUILD.replace(
    'print("adapted:"',
    'print("trainable:", ",".join(n for n, p in model.named_parameters() '
    'if p.requires_grad and ".lora." not in n)); print("adapted:"',
)


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


TIED = TRAINABLE.replace("TinyGPTSpec()", "TinyGPTSpec(tie_embeddings=True)")


@pytest.mark.parametrize(
    "script, value, trainable",
    [
        (TRAINABLE, "output_layer", "output_layer.weight"),
        (TRAINABLE, "word_embeddings", "embedding.word_embeddings.weight"),
        (TRAINABLE, "*", "embedding.word_embeddings.weight,output_layer.weight"),
        (TRAINABLE, "", ""),
        (TIED, "output_layer", "embedding.word_embeddings.weight"),  # tied: one weight, whichever is named
    ],
)
def test_only_the_named_weights_stay_trainable(script, value, trainable):
    result = run_fresh(["-c", script], MEGATRON_PLUGINS="lora_correct", MEGATRON_LORA_MODULES_TO_SAVE=value)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trainable: {trainable}\n" in result.stdout, result.stdout


def test_a_module_both_adapted_and_trained_fully_stops_the_model_build():
    env = {"MEGATRON_LORA_MODULES_TO_SAVE": "output_layer", "MEGATRON_LORA_TARGETS": "linear_qkv,output_layer"}
    assert_one_line_error(
        run_fresh(["-c", BUILD], MEGATRON_PLUGINS="lora_correct", **env),
        "output_layer is both a LoRA target and in MEGATRON_LORA_MODULES_TO_SAVE; keep it in one of them",
    )


DESCRIPTION = {"modules_to_save": ["output_layer"]}


def test_peft_modules_to_save_must_be_the_models():
    weight = {"base_model.model.lm_head.weight": object(), "lora": object()}
    rest, full = peft_modules.split(weight, {"modules_to_save": ["lm_head"]}, DESCRIPTION, "dir", PeftFormatError)
    assert set(rest) == {"lora"} and set(full) == {"output_layer"}
    cases = [
        (
            {"modules_to_save": None},
            DESCRIPTION,
            "dir: modules_to_save=[] but the model trains fully ['lm_head']; "
            "build it with MEGATRON_LORA_MODULES_TO_SAVE unset",
        ),
        (
            {"modules_to_save": ["lm_head"]},
            {},
            "dir: modules_to_save=['lm_head'] but the model trains fully []; "
            "build it with MEGATRON_LORA_MODULES_TO_SAVE=output_layer",
        ),
        (
            {"modules_to_save": ["score"]},
            {},
            "dir: modules_to_save entry 'score' cannot train fully in Megatron; supported: lm_head, embed_tokens",
        ),
    ]
    for config, description, message in cases:
        with pytest.raises(PeftFormatError) as raised:
            peft_modules.split(weight, config, description, "dir", PeftFormatError)
        assert str(raised.value) == message
    with pytest.raises(PeftFormatError) as raised:
        peft_modules.split({}, {"modules_to_save": ["lm_head"]}, DESCRIPTION, "dir", PeftFormatError)
    assert str(raised.value) == "dir: missing base_model.model.lm_head.weight (the fully trained Megatron output_layer)"


TIED_DESCRIPTION = {"modules_to_save": ["output_layer"], "tied_embeddings": True}
TIED_CONFIG = {"modules_to_save": ["embed_tokens", "model.embed_tokens"], "ensure_weight_tying": True}  # as peft writes


def test_tied_embeddings_need_peft_weight_tying():
    import torch

    weight = torch.ones(2, 2)
    tensors = {"base_model.model.lm_head.weight": weight, "base_model.model.model.embed_tokens.weight": weight}
    rest, full = peft_modules.split(dict(tensors, lora=weight), TIED_CONFIG, TIED_DESCRIPTION, "dir", PeftFormatError)
    assert set(rest) == {"lora"} and set(full) == {"embedding.word_embeddings"}
    untied = {"modules_to_save": ["embed_tokens", "lm_head"]}
    with pytest.raises(PeftFormatError) as raised:
        peft_modules.split(tensors, untied, TIED_DESCRIPTION, "dir", PeftFormatError)
    assert str(raised.value) == (
        "dir: the model's tied embeddings train fully as one weight, the adapter needs modules_to_save with "
        "embed_tokens and ensure_weight_tying=true (train it so in peft)"
    )
    apart = dict(tensors, **{"base_model.model.lm_head.weight": weight + 1})
    with pytest.raises(PeftFormatError) as raised:
        peft_modules.split(apart, TIED_CONFIG, TIED_DESCRIPTION, "dir", PeftFormatError)
    assert str(raised.value) == "dir: base_model.model.lm_head.weight differs from the tied embedding it must equal"
