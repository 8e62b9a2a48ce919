"""PEFT export / import of MoE expert adapters, checked against `transformers` + `peft`.

An MoE model (4 SequentialMLP experts, top-2, GQA attention) trains its adapters (3 Adam steps
from a non-zero init, distinct per expert) and writes an adapter-only checkpoint at EP2
(Qwen3-MoE: q / k layernorm) or TP2 + ETP2 with SP (Mixtral); the `export` CLI turns it into a PEFT adapter whose
experts use `target_parameters`
(lora/exchange/experts.py); `peft` loads it into a `Qwen3MoeForCausalLM` / `MixtralForCausalLM`
holding the same base weights (transformers' 3D expert parameters), and its logits must equal
the Megatron forward (fp32). Negative controls: the
base model alone, and the same adapter with two experts' adapters swapped. The adapter is then
imported at the other expert topology, saved and exported again without naming the family (inferred):
identical bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import persistence_worker as worker
import pytest
import resume_worker
import torch
from error_metrics import max_abs_error_over_max

from megatron_lora_patch.lora.exchange import names as peft_names
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec

SPEC = TinyGPTSpec.moe(moe_ffn_hidden_size=32)
# max-abs error relative to the largest logit, fp32; measured 4.1e-7 (Mixtral, TP2 + ETP2) and 5.6e-7 (Qwen3-MoE, EP2)
LOGITS_TOLERANCE = 1e-5
EXPORT_SEED = 23
TRAIN_STEPS = 3
#: case -> (saved at, HF family, testbed spec, imported at: another EP and ETP). ETP2 rides with TP2: at
#: EP1 and DP2, Megatron-Core 0.13's `DDP.broadcast_params` (the testing driver calls it) overwrites
#: rank 1's expert-TP shards with rank 0's (it broadcasts them over dense DP).
CASES = {
    "ep2-qwen3_moe": ("ep2", "qwen3_moe", dataclasses.replace(SPEC, qk_layernorm=True), "etp2"),
    "tp2-etp2-sp-mixtral": ("tp2-etp2-sp", "mixtral", SPEC, "ep2"),
}


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    # cwd outside the checkout: `-m` from the repo root would shadow the installed package.
    return subprocess.run([sys.executable, "-m", "megatron_lora_patch", *args], cwd=cwd, capture_output=True, text=True)


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    """A run at the case's topology: Megatron logits with adapters, its adapter-only checkpoint, the CLI's PEFT
    export."""
    topology, family, spec, other = CASES[request.param]
    root = tmp_path_factory.mktemp(f"peft-moe-{request.param}")
    checkpoint, peft_dir = str(root / "checkpoint"), str(root / "peft")
    args = (topology, spec, EXPORT_SEED, TRAIN_STEPS, checkpoint)
    results = run_world(resume_worker.train_and_save_world, 2, args=args, name=topology, timeout=300)
    done = _cli("export", "--checkpoint", checkpoint, "--out", peft_dir, "--family", family, cwd=root)
    assert done.returncode == 0, done.stderr
    trained = worker.assemble([result["adapters"] for result in results])
    return {
        "root": root,
        "peft": peft_dir,
        "adapted": results[0]["adapted"],
        "trained": trained,
        "family": family,
        "spec": spec,
        "other": other,
    }


def _hf_model(exported):
    import hf_llama

    build = hf_llama.qwen3_moe_for if exported["family"] == "qwen3_moe" else hf_llama.mixtral_for
    return build(exported["spec"], resume_worker.SETTINGS.seed)


def _peft_logits(exported, peft_dir: str) -> torch.Tensor:
    from peft import PeftModel

    model = PeftModel.from_pretrained(_hf_model(exported), peft_dir).eval()
    with torch.no_grad():
        return model(worker.batch(exported["spec"])[0]).logits


def test_peft_loads_expert_export_and_matches_megatron_logits(exported):
    with open(os.path.join(exported["peft"], peft_names.CONFIG_NAME)) as handle:
        config = json.load(handle)
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    error = max_abs_error_over_max(_peft_logits(exported, exported["peft"]), exported["adapted"])
    print(f"peft vs Megatron logits ({exported['family']}): max-abs / max = {error:.3e}")
    assert error <= LOGITS_TOLERANCE
    with torch.no_grad():  # the adapters matter: the base model alone is far off
        base = _hf_model(exported)(worker.batch(exported["spec"])[0]).logits
    assert max_abs_error_over_max(base, exported["adapted"]) > 100 * LOGITS_TOLERANCE


def _swap_experts(tensor: torch.Tensor, factor: str, first: int, second: int) -> torch.Tensor:
    """The packed PEFT factor with experts `first` and `second` exchanged (A: expert-major rows, B: expert-minor
    columns)."""
    num = SPEC.num_experts
    per_expert = (
        tensor.reshape(num, -1, tensor.shape[-1]) if factor == "A" else tensor.reshape(tensor.shape[0], -1, num)
    )
    order = list(range(num))
    order[first], order[second] = second, first
    swapped = per_expert[order] if factor == "A" else per_expert[..., order]
    return swapped.reshape(tensor.shape).contiguous()


def test_swapped_expert_adapters_move_peft_logits_off(exported, tmp_path):
    """Negative control: experts 0 and 1 exchange adapters (every layer, both parameters) -> logits far off."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(exported["peft"], peft_names.WEIGHTS_NAME))
    swapped = {
        key: _swap_experts(value, key.split(".lora_")[1][0], 0, 1) if ".experts." in key else value
        for key, value in tensors.items()
    }
    assert any(not torch.equal(swapped[key], tensors[key]) for key in tensors)
    broken = tmp_path / "swapped"
    broken.mkdir()
    save_file(swapped, str(broken / peft_names.WEIGHTS_NAME), metadata={"format": "pt"})
    for name in (peft_names.CONFIG_NAME, peft_names.METADATA_NAME):
        (broken / name).write_bytes(open(os.path.join(exported["peft"], name), "rb").read())
    assert max_abs_error_over_max(_peft_logits(exported, str(broken)), exported["adapted"]) > 100 * LOGITS_TOLERANCE


def test_import_at_other_expert_topology_then_export_gives_identical_bytes(exported):
    from megatron_lora_patch.lora.exchange.transfer import export_peft

    topology, spec = exported["other"], exported["spec"]
    checkpoint, again = str(exported["root"] / f"reimported-{topology}"), str(exported["root"] / "peft-again")
    results = run_world(
        worker.import_and_save_world, 2, args=(topology, spec, exported["peft"], checkpoint), name=topology, timeout=300
    )
    logical = worker.assemble(results)
    expected = exported["trained"]
    assert set(logical) == set(worker.adapter_names(spec)) == set(expected), sorted(set(logical) ^ set(expected))
    initial = worker.expected_logical(spec, worker.lora_config(EXPORT_SEED))
    assert not any(torch.equal(expected[name][1], initial[name][1]) for name in expected)  # training moved every B
    assert all(all(map(torch.equal, logical[name], expected[name])) for name in expected)
    export_peft(checkpoint, again)  # no family: inferred from the recorded q / k layernorm (issue 27), same bytes
    for name in (peft_names.WEIGHTS_NAME, peft_names.CONFIG_NAME, peft_names.METADATA_NAME):
        with open(os.path.join(exported["peft"], name), "rb") as first, open(os.path.join(again, name), "rb") as second:
            assert first.read() == second.read(), name
