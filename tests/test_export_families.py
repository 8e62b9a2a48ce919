"""`export` checks the Hugging Face family against the model the checkpoint records (issue 27).

A Megatron-defaults GPT (learned absolute positions, LayerNorm, non-gated GeLU, biases, tied) is
refused under every family with one line naming each mismatch; a checkpoint without the
architecture fields exports with one warning saying what it assumed; the family is inferred
where unambiguous (MoE: tests/test_persistence_peft_moe.py re-exports without `--family`);
exported files get the umask's modes, like `save_pretrained` output. The per-family rules
(lora/exchange/families.py) are checked on descriptions, one mismatch at a time.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import families_worker as worker
import pytest
import torch
from conftest import assert_one_line_error, clean_environ

from megatron_lora_patch.lora.exchange import families
from megatron_lora_patch.lora.exchange.names import PeftFormatError
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec

SPEC = TinyGPTSpec()
LLAMA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "gated_linear_unit": True, "activation": "silu",
         "qk_layernorm": False, "add_bias_linear": False, "add_qkv_bias": False, "num_experts": 0}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    (description,) = run_world(worker.save_world, 1, args=(SPEC, str(root)), name="tp1", timeout=240)
    return root, description


def export(root, checkpoint: str, out: str, *options: str, umask: int = 0o022) -> subprocess.CompletedProcess:
    command = [sys.executable, "-P", "-m", "megatron_lora_patch", "export", "--checkpoint", checkpoint, "--out", out]
    return subprocess.run(command + list(options), env=clean_environ(), capture_output=True, text=True, timeout=300,
                          cwd=str(root), preexec_fn=lambda: os.umask(umask))


def test_the_description_records_what_megatron_built(saved):
    _, description = saved
    assert {key: description[key] for key in LLAMA} == {
        "position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "gated_linear_unit": False,
        "activation": "gelu", "qk_layernorm": False, "add_bias_linear": True, "add_qkv_bias": False, "num_experts": 0,
    }
    assert description["tied_embeddings"] is True


@pytest.mark.parametrize("family", [None, "llama"])
def test_megatron_defaults_are_refused_naming_every_mismatch(saved, family):
    root, _ = saved
    options = ["--family", family] if family else []
    done = export(root, worker.DEFAULTS, "peft", *options)
    assert_one_line_error(done, (
        "--family llama cannot represent the checkpoint's model: learned_absolute position embeddings (llama: rope), "
        "LayerNorm (llama: RMSNorm), a non-gated MLP (llama: gated, e.g. --swiglu); no family (llama, mistral, qwen2, "
        "qwen3, qwen3_moe, mixtral, qwen2_moe, deepseek_v3) can hold it: export needs a Llama-style model (rope, "
        "RMSNorm, gated MLP), or merge the adapter into the Megatron weights instead"), returncode=2)
    assert not (root / "peft").exists() and done.stdout == ""


def test_older_checkpoint_exports_saying_what_it_assumed(saved):
    root, _ = saved
    done = export(root, worker.OLDER, "peft-older")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        "the checkpoint does not record position_embedding_type, normalization, activation, qk_layernorm, "
        "add_bias_linear, add_qkv_bias (written by an older megatron-lora-patch); assumed what llama needs: "
        "position_embedding_type=rope, normalization=RMSNorm, activation=silu, qk_layernorm=False, "
        "add_bias_linear=False, add_qkv_bias=False"
    ]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_follow_the_umask_like_save_pretrained(saved, umask):
    root, _ = saved
    out = root / f"peft-{umask:o}"
    done = export(root, worker.OLDER, str(out), umask=umask)
    assert done.returncode == 0, done.stderr[-3000:]
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert {stat.S_IMODE(path.stat().st_mode) for path in out.iterdir()} == {0o666 & ~umask}


@pytest.mark.parametrize("change, family, phrase", [
    ({"qk_layernorm": True}, "llama", "q / k layernorm (llama: without)"),
    ({}, "qwen3", "no q / k layernorm (qwen3: with)"),
    ({"num_experts": 4}, "llama", "MoE layers (llama: dense)"),
    ({}, "mixtral", "dense layers (mixtral: MoE)"),
    ({"add_qkv_bias": True}, "mistral", "q / k / v biases (mistral: none)"),
    ({"add_bias_linear": True}, "qwen2", "all linear biases (qwen2: qkv)"),
    ({"activation": "fast_gelu"}, "llama", "activation fast_gelu (transformers: silu, gelu, quick_gelu"),
    ({"position_embedding_type": "mrope"}, "llama", "mrope position embeddings (llama: rope)"),
    ({"multi_latent_attention": True}, "llama", "multi-latent attention (llama: q / k / v)"),
    ({"qk_layernorm": True}, "deepseek_v3", "q / k / v (GQA) attention (deepseek_v3: multi-latent)"),
    ({"multi_latent_attention": True}, "deepseek_v3",  # q_lora_rank unset on the local layers: no latent norms
     "no latent layernorms (deepseek_v3: q_a_layernorm / kv_a_layernorm; Megatron-Core's local layers build none "
     "when q_lora_rank is unset, Transformer Engine's layers do)"),
])
def test_each_mismatch_is_named_with_the_family_that_fits(change, family, phrase):
    with pytest.raises(PeftFormatError, match="cannot represent") as refused:
        families.resolve({**LLAMA, **change}, family, "--family")
    assert phrase in str(refused.value) and len(str(refused.value).splitlines()) == 1


@pytest.mark.parametrize("change, inferred", [
    ({}, "llama"), ({"qk_layernorm": True}, "qwen3"), ({"num_experts": 4}, "mixtral"),
    ({"num_experts": 4, "qk_layernorm": True}, "qwen3_moe"), ({"add_qkv_bias": True}, "llama"),
    ({"multi_latent_attention": True, "qk_layernorm": True}, "deepseek_v3"),  # all layers dense
    ({"multi_latent_attention": True, "qk_layernorm": True, "num_experts": 4}, "deepseek_v3"),
    ({"qk_layernorm": True, "targets": ["linear_kv_down_proj", "linear_proj"]}, "deepseek_v3"),  # older: no field
])
def test_family_is_inferred_where_unambiguous(change, inferred):
    assert families.resolve({**LLAMA, **change}, None) == inferred


def test_an_older_moe_checkpoint_asks_for_the_family():
    older = {key: value for key, value in LLAMA.items() if key != "qk_layernorm"}
    with pytest.raises(PeftFormatError, match="pass --family qwen3_moe .with. or mixtral .without.$"):
        families.resolve({**older, "num_experts": 4}, None, "--family")



def test_mla_adapters_convert_one_to_one_and_back_and_other_families_refuse_them():
    from megatron_lora_patch.lora.exchange import peft as peft_format

    description = {"rank": 2, "alpha": 4.0, "num_layers": 1, "gated_linear_unit": True, "num_experts": 0}
    generator = torch.Generator().manual_seed(0)
    logical = {f"decoder.layers.0.self_attention.{name}": (torch.randn(2, 8, generator=generator),
                                                           torch.randn(6, 2, generator=generator))
               for name in ("linear_q_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")}
    tensors, config = peft_format.to_peft(logical, description, "deepseek_v3")
    assert config["target_modules"] == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_proj"]
    key = "base_model.model.model.layers.0.self_attn.kv_a_proj_with_mqa.lora_B.weight"
    assert torch.equal(tensors[key], logical["decoder.layers.0.self_attention.linear_kv_down_proj"][1])
    back = peft_format.from_peft(tensors, config, description, logical, family="deepseek_v3")
    assert all(torch.equal(back[name][i], logical[name][i]) for name in logical for i in (0, 1))
    with pytest.raises(PeftFormatError) as refused:
        peft_format.to_peft(logical, description, "llama")
    assert str(refused.value).endswith("this model family has no multi-latent attention; use --family deepseek_v3")
