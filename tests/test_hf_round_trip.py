"""HF in, HF out (issue 27): a tiny Hugging Face Llama made in code -> a Megatron-LM base checkpoint ->
LoRA with the unchanged launch script at TP2 -> `megatron-lora-patch export` -> `PeftModel.from_pretrained`
on the same HF model, whose logits must equal Megatron's.

The converter is `tests/hf_to_megatron.py`, the CPU stand-in for Megatron-Bridge's `AutoBridge.import_ckpt`
(README "From a Hugging Face model and back" says why Bridge cannot run on CPU CI); the fine-tune is
`tests/megatron_lm_gpt.py` (`pretrain_gpt.py`'s shape) under `torchrun`, as in tests/test_megatron_lm_loop.py.
Tolerance: max-abs logits error over the largest logit, fp32, 1e-5 (tests/test_persistence_peft.py measures
the noise); the negative control is the HF base without the adapter (>= 100x).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("megatron.training") is None:
    pytest.skip("megatron.training is absent: megatron-core < 0.17 ships no training loop", allow_module_level=True)

import hf_to_megatron  # noqa: E402
import loop_worker  # noqa: E402
import persistence_worker  # noqa: E402
from conftest import clean_environ  # noqa: E402
from error_metrics import max_abs_error_over_max  # noqa: E402
from megatron_lm_runs import LORA_ENV, LORA_RANK, SPEC, TOPOLOGIES, _launch  # noqa: E402

from megatron_lora_patch.proof.testbed.launcher import run_world  # noqa: E402

TOLERANCE = 1e-5
HF_SEED = 5
BASE_INFO = "holds no adapters (a base checkpoint): the base weights load as saved"


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """The HF model saved, converted, fine-tuned at TP2 and exported; the logits of every stage."""
    root = tmp_path_factory.mktemp("hf-round-trip")
    hf_model = hf_to_megatron.new_llama(SPEC, HF_SEED)
    hf_model.save_pretrained(root / "hf")
    (converted,) = run_world(hf_to_megatron.convert_world, 1, args=(SPEC, str(root / "hf"), str(root / "base")),
                             name="convert", timeout=240)
    args, ranks, _ = TOPOLOGIES["tp2"]
    args = args + ["--load", str(root / "base"), "--finetune", "--save", str(root / "lora"), "--save-interval", "4"]
    run = _launch(sys.executable, ranks, args, LORA_ENV, root / "rec-lora")
    export = ["export", "--checkpoint", str(root / "lora"), "--out", str(root / "peft")]
    done = subprocess.run([sys.executable, "-m", "megatron_lora_patch", *export], cwd=str(root), capture_output=True,
                          text=True, env=clean_environ())
    assert done.returncode == 0, done.stderr[-3000:]
    weights = hf_to_megatron.megatron_weights(hf_model.state_dict(), SPEC)
    (megatron,) = run_world(loop_worker.logits_world, 1, name="logits",
                            args=(SPEC, weights, str(root / "lora" / "iter_0000004"), LORA_RANK))
    return {"root": root, "converted": converted, "megatron": megatron, "run": run.stdout + run.stderr}


def _hf_logits(root, adapter: bool) -> torch.Tensor:
    """Logits of the HF model loaded from its own files (with the exported adapter, or without)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    if adapter:
        model = PeftModel.from_pretrained(model, str(root / "peft")).eval()
    tokens, _ = persistence_worker.batch(SPEC)
    with torch.no_grad():
        return model(tokens).logits


def test_the_converted_checkpoint_is_the_hf_model_and_the_lora_run_loads_it(round_trip):
    error = max_abs_error_over_max(round_trip["converted"], _hf_logits(round_trip["root"], adapter=False))
    print(f"converted Megatron vs HF base {error:.2e}")
    assert error <= TOLERANCE
    loaded = [line for line in round_trip["run"].splitlines() if "loading release" in line or BASE_INFO in line]
    assert len(loaded) == 2 and "loading release distributed checkpoint from" in loaded[0], loaded


def test_peft_on_the_same_hf_model_gives_megatrons_logits(round_trip):
    root, megatron = round_trip["root"], round_trip["megatron"]
    peft_logits, base = _hf_logits(root, adapter=True), _hf_logits(root, adapter=False)
    error, control = max_abs_error_over_max(peft_logits, megatron), max_abs_error_over_max(base, megatron)
    print(f"peft vs Megatron {error:.2e}; HF base without the adapter {control:.2e}")
    assert error <= TOLERANCE and control >= 100 * TOLERANCE
    assert json.loads((root / "peft" / "megatron_lora_patch.json").read_text()) == {"family": "llama"}  # inferred
