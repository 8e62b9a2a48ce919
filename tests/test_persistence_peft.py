"""PEFT export / import and merge, checked against `transformers` + `peft` (libraries nobody here wrote).

A TP2 model (GQA, SwiGLU) with non-zero adapters writes an adapter-only checkpoint; the
`export` CLI turns it into a PEFT adapter; `peft` loads it into a `LlamaForCausalLM`
holding the same base weights, and its logits must equal the Megatron forward (fp32).
The PEFT adapter is then imported on PP2, saved and exported again: identical bytes.
Each runs twice: with the default settings, and with rsLoRA plus per-module ranks and alphas
(PEFT's `use_rslora`, `rank_pattern`, `alpha_pattern`). peft loads the export without warning
about unknown config keys (our metadata sits in its own file).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings

import persistence_worker as worker
import pytest
import torch
from error_metrics import max_abs_error_over_max

from megatron_lora_patch.lora.exchange import files as peft_files
from megatron_lora_patch.lora.exchange import names as peft_names
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import DEFAULT_SEED, TinyGPTSpec

SPEC = TinyGPTSpec()  # 4 heads in 2 query groups (GQA), SwiGLU, RoPE, RMSNorm, untied embeddings
LOGITS_TOLERANCE = 1e-5  # max-abs error relative to the largest logit, fp32
EXPORT_SEED = 21
# LoraConfig options of each run, the PEFT config fields they must become, and config changes
# that must move peft's logits far off (negative controls).
VARIANTS = {
    "defaults": ({}, {"use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}}, [{"lora_alpha": 16.0}]),
    "rslora_patterns": (
        {"rslora": True, "rank_pattern": {"linear_fc1": 2, "linear_fc2": 2}, "alpha_pattern": {"linear_proj": 4.0}},
        {
            "use_rslora": True,
            "rank_pattern": {"gate_proj": 2, "up_proj": 2, "down_proj": 2},
            "alpha_pattern": {"o_proj": 4.0},
        },
        [{"alpha_pattern": {}}, {"use_rslora": False}],
    ),
    # q / k / v and gate / up with their own A and B, as standard PEFT LoRA (lora/adapters/projections.py)
    "separate_projections": ({"separate_projections": True}, {}, [{"lora_alpha": 16.0}]),
}


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    # cwd outside the checkout: `-m` from the repo root would shadow the installed package.
    return subprocess.run([sys.executable, "-m", "megatron_lora_patch", *args], cwd=cwd, capture_output=True, text=True)


@pytest.fixture(scope="module", params=list(VARIANTS))
def exported(request, tmp_path_factory):
    """TP2 run: Megatron logits (adapted / merged / unmerged), its checkpoint, and the CLI's PEFT export."""
    options, peft_fields, controls = VARIANTS[request.param]
    root = tmp_path_factory.mktemp(f"peft-{request.param}")
    checkpoint, peft_dir = str(root / "checkpoint"), str(root / "peft")
    results = run_world(
        worker.export_and_merge_world, 2, args=("tp2", SPEC, EXPORT_SEED, checkpoint, options), name="tp2", timeout=240
    )
    done = _cli("export", "--checkpoint", checkpoint, "--out", peft_dir, cwd=root)
    assert done.returncode == 0, done.stderr
    return {
        "root": root,
        "checkpoint": checkpoint,
        "peft": peft_dir,
        "ranks": results,
        "options": options,
        "fields": peft_fields,
        "controls": controls,
    }


def _unexpected_key_warnings(peft_dir: str) -> list:
    from peft import PeftConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PeftConfig.from_pretrained(peft_dir)
    return [str(w.message) for w in caught if "Unexpected keyword" in str(w.message)]


def test_peft_loads_export_and_matches_megatron_logits(exported):
    import hf_llama
    from peft import PeftModel

    megatron_logits = exported["ranks"][0]["adapted"]
    tokens, _ = worker.batch(SPEC)
    base = hf_llama.llama_for(SPEC, DEFAULT_SEED)
    with torch.no_grad():
        base_logits = base(tokens).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, exported["peft"]).eval()
    assert not [str(w.message) for w in caught if "Unexpected keyword" in str(w.message)]
    with torch.no_grad():
        peft_logits = model(tokens).logits
    assert max_abs_error_over_max(peft_logits, megatron_logits) <= LOGITS_TOLERANCE
    # The adapter matters: without it the logits are far off (so the check above is not vacuous).
    assert max_abs_error_over_max(base_logits, megatron_logits) > 100 * LOGITS_TOLERANCE
    with open(os.path.join(exported["peft"], peft_names.CONFIG_NAME)) as handle:
        config = json.load(handle)
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert {field: config[field] for field in exported["fields"]} == exported["fields"]
    assert "megatron_lora_patch" not in config


def test_peft_config_fields_decide_the_logits(exported, tmp_path):
    """Negative controls: the same tensors with one PEFT config field changed (lora_alpha;
    alpha_pattern dropped, use_rslora off) give logits far from Megatron's, so the match above
    needs every field right."""
    import hf_llama
    from peft import PeftModel

    tokens, _ = worker.batch(SPEC)
    config = json.loads(open(os.path.join(exported["peft"], peft_names.CONFIG_NAME)).read())
    for index, change in enumerate(exported["controls"]):
        broken = tmp_path / f"control{index}"
        shutil.copytree(exported["peft"], broken)
        (broken / peft_names.CONFIG_NAME).write_text(json.dumps({**config, **change}))
        model = PeftModel.from_pretrained(hf_llama.llama_for(SPEC, DEFAULT_SEED), str(broken)).eval()
        with torch.no_grad():
            logits = model(tokens).logits
        assert max_abs_error_over_max(logits, exported["ranks"][0]["adapted"]) > 100 * LOGITS_TOLERANCE, change


def test_separate_projections_export_untied_a_and_tying_them_moves_the_logits(exported, tmp_path):
    """With separate projections q / k / v (gate / up) export different lora_A's, and they matter:
    the same adapter with k's and v's A replaced by q's (the shared-A model) is far off Megatron's logits.
    In the shared layout all three are equal."""
    import hf_llama
    from peft import PeftModel
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(exported["peft"], peft_names.WEIGHTS_NAME))
    key = "base_model.model.model.layers.0.self_attn.{}_proj.lora_A.weight"
    separate = exported["options"].get("separate_projections", False)
    assert torch.equal(tensors[key.format("q")], tensors[key.format("k")]) != separate
    if not separate:
        return
    tied = tmp_path / "tied"
    shutil.copytree(exported["peft"], tied)
    for name in [name for name in tensors if ".k_proj.lora_A" in name or ".v_proj.lora_A" in name]:
        tensors[name] = tensors[name.replace(".k_proj.", ".q_proj.").replace(".v_proj.", ".q_proj.")].clone()
    save_file(tensors, str(tied / peft_names.WEIGHTS_NAME))
    model = PeftModel.from_pretrained(hf_llama.llama_for(SPEC, DEFAULT_SEED), str(tied)).eval()
    with torch.no_grad():
        logits = model(worker.batch(SPEC)[0]).logits
    assert max_abs_error_over_max(logits, exported["ranks"][0]["adapted"]) > 100 * LOGITS_TOLERANCE


def test_peft_warns_only_about_the_old_embedded_metadata(exported, tmp_path):
    """The export loads without an "Unexpected keyword" warning; the previous layout (our key
    inside adapter_config.json) does warn, and our import still reads it."""
    assert _unexpected_key_warnings(exported["peft"]) == []
    old = tmp_path / "old-layout"
    shutil.copytree(exported["peft"], old)
    os.remove(old / peft_names.METADATA_NAME)
    config = json.loads((old / peft_names.CONFIG_NAME).read_text())
    (old / peft_names.CONFIG_NAME).write_text(json.dumps({**config, "megatron_lora_patch": {"family": "qwen2"}}))
    assert len(_unexpected_key_warnings(str(old))) == 1
    assert peft_files.read(str(old))[2] == "qwen2"


def test_merge_equals_adapter_forward_and_unmerge_restores(exported):
    for rank in exported["ranks"]:
        assert rank["merged_count"] == 4 * SPEC.num_layers
        assert max_abs_error_over_max(rank["merged"], rank["adapted"]) <= LOGITS_TOLERANCE
        assert max_abs_error_over_max(rank["unmerged"], rank["adapted"]) <= LOGITS_TOLERANCE
        assert rank["weight_drift"] <= 1e-7  # fp32 rounding of W + d - d on |W| ~ 0.1


def test_import_on_pp2_then_export_gives_identical_bytes(exported):
    from megatron_lora_patch.lora.exchange.transfer import export_peft

    checkpoint, again = str(exported["root"] / "reimported"), str(exported["root"] / "peft-again")
    args = ("pp2", SPEC, exported["peft"], checkpoint, exported["options"])
    results = run_world(worker.import_and_save_world, 2, args=args, name="pp2", timeout=240)
    logical = worker.assemble(results)
    expected = worker.expected_logical(SPEC, worker.lora_config(EXPORT_SEED, **exported["options"]))
    assert len(expected) == 4 * SPEC.num_layers and set(logical) == set(expected), sorted(set(logical) ^ set(expected))
    assert all(all(map(torch.equal, logical[name], expected[name])) for name in expected)
    export_peft(checkpoint, again)
    for name in (peft_names.WEIGHTS_NAME, peft_names.CONFIG_NAME, peft_names.METADATA_NAME):
        with open(os.path.join(exported["peft"], name), "rb") as first, open(os.path.join(again, name), "rb") as second:
            assert first.read() == second.read(), name
