"""DoRA both ways with PEFT (issue 37 item 4), checked against `transformers` + `peft`.

Export: a TP2 DoRA model (GQA, SwiGLU; its magnitudes moved off their initial norm, as training moves them)
writes an adapter-only checkpoint; the `export` CLI writes `use_dora: true` and each HF module's
`lora_magnitude_vector` (the fused qkv / fc1 `m` split by the rows B splits by); `PeftModel.from_pretrained` on the
same base weights gives Megatron's logits (fp32, 1e-5). Negative controls: the same adapter without its
magnitudes (peft then sets them from the weights) or loaded as plain LoRA is >= 100x off.
Import: a DoRA adapter made and trained two steps in peft (so its `m` is no longer ||W + s B A||) continues at
TP2: the imported model's logits and first loss equal peft's, and its export gives peft's tensors back bitwise.
Merge: the TP2 model merged as PEFT merges DoRA gives the adapter forward's logits; unmerge restores the weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import dora_peft_worker as worker
import pytest
import torch
from error_metrics import max_abs_error_over_max
from persistence_worker import batch
from safetensors.torch import load_file, save_file

from megatron_lora_patch.lora.exchange import names as peft_names
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import DEFAULT_SEED, TinyGPTSpec

SPEC = TinyGPTSpec()  # 4 heads in 2 query groups (GQA), SwiGLU, RoPE, RMSNorm, untied embeddings
TOLERANCE = 1e-5  # max-abs error relative to the largest logit (and relative loss error), fp32
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAGNITUDE = peft_names.MAGNITUDE_KEY


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    # cwd outside the checkout: `-m` from the repo root would shadow the installed package.
    return subprocess.run([sys.executable, "-m", "megatron_lora_patch", *args], cwd=cwd, capture_output=True, text=True)


def _peft_logits(peft_dir: str) -> torch.Tensor:
    import hf_llama
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf_llama.llama_for(SPEC, DEFAULT_SEED), peft_dir).eval()
    with torch.no_grad():
        return model(batch(SPEC)[0]).logits


def _loss(logits: torch.Tensor) -> float:
    tokens = batch(SPEC)[0]
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).item()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The TP2 DoRA run's logits and the CLI's PEFT export of its checkpoint."""
    root = tmp_path_factory.mktemp("peft-dora")
    checkpoint, peft_dir = str(root / "checkpoint"), str(root / "peft")
    results = run_world(worker.export_world, 2, args=("tp2", SPEC, 21, checkpoint, {}), name="tp2", timeout=240)
    done = _cli("export", "--checkpoint", checkpoint, "--out", peft_dir, cwd=root)
    assert done.returncode == 0, done.stderr
    return {"peft": peft_dir, "adapted": results[0]["adapted"], "ranks": results}


def test_dora_merge_equals_the_adapter_forward_and_unmerge_restores(exported):
    """PEFT's DoRA merge at TP2 (column- and row-parallel layers). Not vacuous: the magnitudes moved off the norm,
    and without them (plain LoRA) the logits are >= 100x off (test_peft_loads_the_dora_export_with_megatron_logits)."""
    for rank in exported["ranks"]:
        assert rank["merged_count"] == 4 * SPEC.num_layers
        assert max_abs_error_over_max(rank["merged"], rank["adapted"]) <= TOLERANCE
        assert max_abs_error_over_max(rank["unmerged"], rank["adapted"]) <= TOLERANCE
        assert rank["weight_drift"] <= 1e-6  # fp32 rounding of (W + d) * c / c - d on |W| ~ 0.1


def test_peft_loads_the_dora_export_with_megatron_logits(exported, tmp_path):
    with open(os.path.join(exported["peft"], peft_names.CONFIG_NAME)) as handle:
        config = json.load(handle)
    assert config["use_dora"] is True and config["target_modules"] == sorted(PROJECTIONS)
    tensors = load_file(os.path.join(exported["peft"], peft_names.WEIGHTS_NAME))
    magnitudes = {key: value for key, value in tensors.items() if key.endswith(f".{MAGNITUDE}")}
    assert len(magnitudes) == len(PROJECTIONS) * SPEC.num_layers
    for key, value in magnitudes.items():  # one entry per output feature of the HF module (lora_B's rows)
        assert value.shape == (tensors[key.replace(MAGNITUDE, "lora_B.weight")].shape[0],), key
    assert max_abs_error_over_max(_peft_logits(exported["peft"]), exported["adapted"]) <= TOLERANCE
    # Negative controls: without the magnitudes (peft sets them to ||W + s B A||), or as plain LoRA.
    without = tmp_path / "without-magnitudes"
    shutil.copytree(exported["peft"], without)
    save_file({k: v for k, v in tensors.items() if k not in magnitudes}, str(without / peft_names.WEIGHTS_NAME))
    plain = tmp_path / "plain"
    shutil.copytree(without, plain)
    (plain / peft_names.CONFIG_NAME).write_text(json.dumps({**config, "use_dora": False}))
    for control in (without, plain):
        assert max_abs_error_over_max(_peft_logits(str(control)), exported["adapted"]) > 100 * TOLERANCE, control


def _train_in_peft(peft_dir: str) -> torch.Tensor:
    """A DoRA adapter made and trained two steps in peft (separate q / k / v and gate / up adapters, as peft has
    them); saved to `peft_dir`; returns its logits on the test batch after training."""
    import hf_llama
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    config = LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=PROJECTIONS, use_dora=True)
    model = get_peft_model(hf_llama.llama_for(SPEC, DEFAULT_SEED), config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = batch(SPEC)[0]
    for _ in range(2):
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(peft_dir)
    with torch.no_grad():
        return model.eval()(tokens).logits


def test_peft_trained_dora_adapter_continues_at_tp2_and_exports_back(tmp_path):
    from megatron_lora_patch.lora.exchange.transfer import export_peft

    peft_dir, checkpoint, again = str(tmp_path / "peft"), str(tmp_path / "checkpoint"), str(tmp_path / "again")
    peft_logits = _train_in_peft(peft_dir)
    tensors = load_file(os.path.join(peft_dir, peft_names.WEIGHTS_NAME))
    results = run_world(
        worker.import_world, 2, args=("tp2", SPEC, peft_dir, checkpoint, {"separate_projections": True}),
        name="tp2", timeout=240,
    )
    logits = results[0]["logits"]
    assert max_abs_error_over_max(logits, peft_logits) <= TOLERANCE
    assert abs(_loss(logits) - _loss(peft_logits)) <= TOLERANCE * abs(_loss(peft_logits))
    # The imported m is used as is: the same adapter with m back at ||W + s B A|| (peft's init) is far off.
    without = tmp_path / "without-magnitudes"
    shutil.copytree(peft_dir, without)
    save_file({k: v for k, v in tensors.items() if not k.endswith(MAGNITUDE)}, str(without / peft_names.WEIGHTS_NAME))
    assert max_abs_error_over_max(_peft_logits(str(without)), logits) > 100 * TOLERANCE
    export_peft(checkpoint, again)
    back = load_file(os.path.join(again, peft_names.WEIGHTS_NAME))
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[key], tensors[key]) for key in tensors)
