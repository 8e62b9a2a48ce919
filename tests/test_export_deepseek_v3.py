"""DeepSeek-V3 out to Hugging Face: adapters of a DeepSeek-shaped Megatron model (multi-latent attention with
both latents, a leading dense layer, MoE layers with sigmoid group-limited routing, a routed scaling factor and
shared experts; tests/hf_deepseek_v3.py) under transformers' `deepseek_v3` names, and back.

Trained-looking adapters on every default target (every MLA linear, the dense MLP, routed and shared experts)
are exported from adapter-only checkpoints written at world size 1 and at TP2 + SP with the family inferred; `peft`
on a `DeepseekV3ForCausalLM` with the same base weights gives Megatron's logits (fp32, 1e-5 of the largest logit).
Negative control: the kv down projection's adapter moved after `kv_a_layernorm` (where the issue says other
projects put it) moves the logits > 100x that. Import: the world-size-1 export, without the file naming its
family (as peft writes an adapter), read into a TP2 + SP model with other adapters gives the same adapter state
again (which is the export, tensor for tensor), and its logits.
"""

from __future__ import annotations

import json
import shutil

import handoff_worker
import hf_deepseek_v3
import persistence_worker
import pytest
import torch
from error_metrics import max_abs_error_over_max

from megatron_lora_patch.lora.exchange.names import METADATA_NAME
from megatron_lora_patch.lora.exchange.transfer import export_peft
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import DEFAULT_SEED

SPEC = hf_deepseek_v3.SPEC
TOLERANCE = 1e-5
SEED = 41


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """World size 1: adapters of `SEED`, exported. TP2 + SP: other adapters, then that export imported (without
    `megatron_lora_patch.json`); exported again. Each run's adapter state, logits and export."""
    root = tmp_path_factory.mktemp("deepseek-v3")
    runs = {}
    for topology, world, seed, peft_dir in (("tp1", 1, SEED, None), ("tp2-sp", 2, SEED + 1, root / "as-peft")):
        checkpoint = str(root / f"checkpoint-{topology}")
        args = (topology, SPEC, seed, checkpoint, "deepseek_v3", {}, False, peft_dir and str(peft_dir))
        runs[topology] = run_world(handoff_worker.state_world, world, args=args, name=topology, timeout=300)[0]
        export_peft(checkpoint, str(root / f"peft-{topology}"))
        if topology == "tp1":  # as peft writes it: no megatron_lora_patch.json naming the family
            shutil.copytree(root / "peft-tp1", root / "as-peft", ignore=shutil.ignore_patterns(METADATA_NAME))
    return root, runs


def _kv_adapter_after_latent_norm(model) -> None:
    """The control: each kv down projection's latent LoRA term added after `kv_a_layernorm` instead of before."""
    for layer in model.base_model.model.model.layers:
        projection, norm, term = layer.self_attn.kv_a_proj_with_mqa, layer.self_attn.kv_a_layernorm, {}
        width = norm.weight.shape[0]

        def drop(module, args, output, term=term, width=width):
            latent = (output - module.base_layer(args[0]))[..., :width]
            term["latent"] = latent
            return output - torch.nn.functional.pad(latent, (0, output.shape[-1] - width))

        projection.register_forward_hook(drop)
        norm.register_forward_hook(lambda module, args, output, term=term: output + term["latent"])


def _peft_logits(directory, misplaced: bool = False) -> torch.Tensor:
    from peft import PeftModel

    with hf_deepseek_v3.without_peft_v4_renames():
        model = PeftModel.from_pretrained(hf_deepseek_v3.deepseek_v3_for(SPEC, DEFAULT_SEED), str(directory)).eval()
    if misplaced:
        _kv_adapter_after_latent_norm(model)
    with torch.no_grad():
        return model(persistence_worker.batch(SPEC)[0]).logits


@pytest.mark.parametrize("topology", ["tp1", "tp2-sp"])
def test_peft_on_deepseek_v3_gives_megatron_logits(exported, topology):
    root, runs = exported
    directory, megatron = root / f"peft-{topology}", runs[topology]["logits"]
    assert json.loads((directory / "megatron_lora_patch.json").read_text()) == {"family": "deepseek_v3"}  # inferred
    error = max_abs_error_over_max(_peft_logits(directory), megatron)
    control = max_abs_error_over_max(_peft_logits(directory, misplaced=True), megatron)
    print(f"{topology}: peft (deepseek_v3) vs Megatron {error:.2e}; kv adapter after the latent norm {control:.2e}")
    assert error <= TOLERANCE and control > 100 * TOLERANCE


def test_import_at_tp2_gives_the_same_adapters_and_the_in_memory_state_the_export(exported):
    from safetensors.torch import load_file

    root, runs = exported
    first, again = runs["tp1"]["tensors"], runs["tp2-sp"]["tensors"]
    assert list(again) == list(first) and all(torch.equal(again[key], first[key]) for key in first)
    on_disk = load_file(str(root / "peft-tp1" / "adapter_model.safetensors"))
    assert list(on_disk) == list(first) and all(torch.equal(on_disk[key], first[key]) for key in first)
    layer0, layer1 = "base_model.model.model.layers.0.", "base_model.model.model.layers.1."
    assert {layer0 + "self_attn.q_a_proj.lora_A.weight", layer0 + "self_attn.kv_a_proj_with_mqa.lora_B.weight",
            layer0 + "mlp.gate_proj.lora_B.weight", layer1 + "mlp.shared_experts.up_proj.lora_A.weight",
            layer1 + "mlp.experts.base_layer.lora_A.weight", layer1 + "mlp.experts.lora_B.weight"} <= set(first)
