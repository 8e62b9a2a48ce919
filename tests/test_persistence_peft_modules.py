"""Fully trained modules through the PEFT format (PEFT's modules_to_save, issue 19), checked against
`transformers` + `peft`.

A TP2 model whose output layer and embedding were trained (seeded noise on their logical weights)
beside its adapters writes an adapter-only checkpoint; the `export` CLI writes PEFT's layout
(`base_model.model.lm_head.weight`, `base_model.model.model.embed_tokens.weight`,
`modules_to_save: ["embed_tokens", "lm_head"]`; tied embeddings: the one weight under both names,
`modules_to_save: ["embed_tokens"]`, `ensure_weight_tying: true`, as peft writes a tied model's);
`peft` loads it into a `LlamaForCausalLM` holding the untrained base weights, wraps both modules as
modules_to_save, and its logits equal Megatron's
(fp32, 1e-5 of the largest logit; measured 7.3e-7). Negative control: the same adapter without the two
weights is far off (measured 0.97). Import on PP2 (other shards than TP2), save adapter-only, reload into a third model:
the weights are exact, and the export again is byte-identical.
"""

from __future__ import annotations

import json
import os
import shutil

import modules_to_save_worker as worker
import persistence_worker
import pytest
import torch
from error_metrics import max_abs_error_over_max
from test_persistence_peft import LOGITS_TOLERANCE, _cli

from megatron_lora_patch.lora.exchange import names as peft_names
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import DEFAULT_SEED, TinyGPTSpec

LM_HEAD, EMBED_TOKENS = "lm_head", "model.embed_tokens"
# name -> (spec, LoraConfig options, the PEFT config fields they give, HF module -> the logical weight it holds)
VARIANTS = {
    "untied": (
        TinyGPTSpec(),  # GQA, SwiGLU, untied embeddings
        {"modules_to_save": ("output_layer", "word_embeddings")},
        {"modules_to_save": ["embed_tokens", "lm_head"], "ensure_weight_tying": False},
        {LM_HEAD: "output_layer.weight", EMBED_TOKENS: "embedding.word_embeddings.weight"},
    ),
    "tied": (  # one weight: naming the output layer trains it; peft ties lm_head to the trained embedding
        TinyGPTSpec(tie_embeddings=True),
        {"modules_to_save": ("output_layer",)},
        {"modules_to_save": ["embed_tokens"], "ensure_weight_tying": True},
        {LM_HEAD: "embedding.word_embeddings.weight", EMBED_TOKENS: "embedding.word_embeddings.weight"},
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def exported(request, tmp_path_factory):
    spec, options, fields, hf_weights = VARIANTS[request.param]
    root = tmp_path_factory.mktemp(f"peft-modules-{request.param}")
    checkpoint, peft_dir = str(root / "checkpoint"), str(root / "peft")
    ranks = run_world(worker.export_world, 2, args=("tp2", spec, 21, checkpoint, options), name="tp2", timeout=240)
    done = _cli("export", "--checkpoint", checkpoint, "--out", peft_dir, cwd=root)
    assert done.returncode == 0, done.stderr
    return {
        "root": root,
        "peft": peft_dir,
        "logits": ranks[0]["logits"],
        "trained": worker.trained_state_dict(spec),
        "saved": worker.assemble([rank["trained"] for rank in ranks], spec),
        "spec": spec,
        "options": options,
        "fields": fields,
        "hf_weights": hf_weights,
    }


def test_export_writes_peft_modules_to_save(exported):
    from safetensors.torch import load_file

    for name in worker.trained_names(exported["spec"]):  # the TP2 ranks held the trained weights (own slicing)
        assert torch.equal(exported["saved"][name], exported["trained"][name]), name
    config = json.loads(open(os.path.join(exported["peft"], peft_names.CONFIG_NAME)).read())
    assert {field: config[field] for field in exported["fields"]} == exported["fields"]
    tensors = load_file(os.path.join(exported["peft"], peft_names.WEIGHTS_NAME))
    for hf_name, name in exported["hf_weights"].items():
        assert torch.equal(tensors[f"base_model.model.{hf_name}.weight"], exported["trained"][name]), hf_name


def _peft_logits(spec, peft_dir: str):
    import hf_llama
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf_llama.llama_for(spec, DEFAULT_SEED), peft_dir).eval()
    with torch.no_grad():
        return model, model(persistence_worker.batch(spec)[0]).logits


def test_peft_loads_modules_to_save_and_matches_megatron_logits(exported, tmp_path):
    from peft.utils import ModulesToSaveWrapper
    from safetensors.torch import load_file, save_file

    model, logits = _peft_logits(exported["spec"], exported["peft"])
    for hf_name, name in exported["hf_weights"].items():
        wrapper = model.base_model.model.get_submodule(hf_name)
        assert isinstance(wrapper, ModulesToSaveWrapper), hf_name
        assert torch.equal(wrapper.modules_to_save["default"].weight, exported["trained"][name]), hf_name
    assert max_abs_error_over_max(logits, exported["logits"]) <= LOGITS_TOLERANCE
    # Negative control: the adapter without its fully trained weights.
    bare = tmp_path / "without-modules"
    shutil.copytree(exported["peft"], bare)
    tensors = load_file(str(bare / peft_names.WEIGHTS_NAME))
    save_file({k: v for k, v in tensors.items() if ".lora_" in k}, str(bare / peft_names.WEIGHTS_NAME))
    config = json.loads((bare / peft_names.CONFIG_NAME).read_text())
    (bare / peft_names.CONFIG_NAME).write_text(
        json.dumps({**config, "modules_to_save": None, "ensure_weight_tying": False})
    )
    control = _peft_logits(exported["spec"], str(bare))[1]
    assert max_abs_error_over_max(control, exported["logits"]) > 100 * LOGITS_TOLERANCE


def test_import_on_pp2_reload_and_export_again_are_exact(exported):
    from megatron_lora_patch.lora.exchange.transfer import export_peft

    spec, names = exported["spec"], worker.trained_names(exported["spec"])
    checkpoint, again = str(exported["root"] / "reimported"), str(exported["root"] / "peft-again")
    args = ("pp2", spec, exported["peft"], checkpoint, exported["options"])
    ranks = run_world(worker.import_world, 2, args=args, name="pp2", timeout=240)
    for phase in ("imported", "reloaded"):
        weights = worker.assemble([rank[phase] for rank in ranks], spec)
        for name in names:
            assert torch.equal(weights[name], exported["trained"][name]), (phase, name)
    before = worker.assemble([rank["before"] for rank in ranks], spec)  # the load really changed them
    assert not any(torch.equal(before[name], exported["trained"][name]) for name in names)
    export_peft(checkpoint, again)
    for name in (peft_names.WEIGHTS_NAME, peft_names.CONFIG_NAME, peft_names.METADATA_NAME):
        with open(os.path.join(exported["peft"], name), "rb") as first, open(os.path.join(again, name), "rb") as second:
            assert first.read() == second.read(), name
