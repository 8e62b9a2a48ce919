"""A Hugging Face Llama -> a Megatron-LM base checkpoint, on CPU: the nearest real path to Megatron-Bridge's
`AutoBridge.import_ckpt` that CPU CI can run (README "From a Hugging Face model and back" says why Bridge
itself cannot).

What Bridge does, done with the same pieces: the HF weights are renamed to Megatron's and packed into its
fused layouts (q / k / v rows into the per-query-group `linear_qkv` rows, gate / up into SwiGLU
`linear_fc1`: lora/adapters/layouts.py, the layouts export inverts), loaded into a real Megatron-Core
`GPTModel` (the local spec `pretrain_gpt.py` builds with `--transformer-impl local`), and saved with
Megatron-Core's own `dist_checkpointing` as Megatron-LM stores a release checkpoint (`release/` and a
`latest_checkpointed_iteration.txt` saying `release`), which `--load DIR --finetune` and
`--pretrained-checkpoint DIR` read, resharding to any TP / PP. `convert_world` also returns the converted
model's logits, so the conversion itself is checked against the HF model.
"""

from __future__ import annotations

import os

import torch

from megatron_lora_patch.lora.adapters.layouts import gate_up_to_fc1, qkv_separate_to_mixed


def new_llama(spec, seed: int):
    """A tiny LlamaForCausalLM made in code with transformers' own init (norms perturbed too, so a swapped
    norm shows), fp32, eval: the user's HF model."""
    from hf_llama import llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(spec))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model.eval()


def megatron_weights(hf: dict, spec) -> dict:
    """The testbed's logical Megatron names for an HF Llama state dict (inverse of hf_llama.hf_state_dict)."""
    weights = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
        "output_layer.weight": hf["lm_head.weight"],
    }
    for layer in range(spec.num_layers):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        q, k, v = (hf[f"{src}self_attn.{p}_proj.weight"] for p in "qkv")
        qkv = qkv_separate_to_mixed(q, k, v, spec.num_query_groups, spec.kv_channels)
        fc1 = gate_up_to_fc1(hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"])
        weights.update({
            dst + "input_layernorm.weight": hf[src + "input_layernorm.weight"],
            dst + "pre_mlp_layernorm.weight": hf[src + "post_attention_layernorm.weight"],
            dst + "self_attention.linear_qkv.weight": qkv,
            dst + "self_attention.linear_proj.weight": hf[src + "self_attn.o_proj.weight"],
            dst + "mlp.linear_fc1.weight": fc1,
            dst + "mlp.linear_fc2.weight": hf[src + "mlp.down_proj.weight"],
        })
    return weights


def convert_world(rank: int, world: int, spec, hf_dir: str, save_dir: str) -> torch.Tensor:
    """Read the HF model saved in `hf_dir`, write it as a Megatron-LM release checkpoint in `save_dir`;
    returns the converted Megatron model's full logits of `persistence_worker.batch`."""
    from megatron.core import dist_checkpointing
    from persistence_worker import full_logits
    from transformers import AutoModelForCausalLM

    from megatron_lora_patch.proof.testbed.models import build_model
    from megatron_lora_patch.proof.testbed.patches import apply_only
    from megatron_lora_patch.proof.testbed.topology import Topology

    apply_only(("cpu_compat",))  # a base: the CPU testbed, no LoRA
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    topology = Topology.parse("tp1")
    with topology.world():
        (model,) = build_model(spec, topology, state_dict=megatron_weights(hf, spec))
        release = os.path.join(save_dir, "release")
        os.makedirs(release)
        state = {"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": 0}
        dist_checkpointing.save(state, release)
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as tracker:
            tracker.write("release")
        return full_logits(model, spec)
