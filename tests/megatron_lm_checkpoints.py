"""Readers of the loop runs' records and checkpoints (losses, model tensors, adapter deltas) and the peft
export check, shared by tests/test_megatron_lm_loop.py and the other tests of Megatron-LM's training loop.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import torch
from conftest import clean_environ
from megatron_lm_runs import GLOBAL_BATCH, LORA_RANK, SPEC

from megatron_lora_patch.lora.adapters.init import logical_factors
from megatron_lora_patch.lora.checkpoints import source as checkpoint_source
from megatron_lora_patch.lora.config import LoraConfig
from megatron_lora_patch.proof.testbed.launcher import run_world


def _step_losses(record: pathlib.Path, data_parallel: int) -> list:
    """Per-iteration loss (summed loss / tokens over the global batch) from the ranks' records."""
    per_rank = [json.loads((record / f"dp{rank}.json").read_text()) for rank in range(data_parallel)]
    per_step = GLOBAL_BATCH // data_parallel
    steps = len(per_rank[0]) // per_step
    losses = []
    for step in range(steps):
        parts = [entry for rank in per_rank for entry in rank[step * per_step : (step + 1) * per_step]]
        losses.append(sum(loss for loss, _ in parts) / sum(tokens for _, tokens in parts))
    return losses


def _model_tensors(directory) -> dict:
    """The model tensors (full logical, no optimizer state) of a checkpoint directory."""
    from megatron.core import dist_checkpointing

    path = checkpoint_source.resolve(str(directory))
    with checkpoint_source.process_group():
        wanted = {
            k: v for k, v in dist_checkpointing.load_tensors_metadata(path).items() if not k.startswith("optimizer.")
        }
        loaded = dist_checkpointing.load(wanted, path, validate_access_integrity=False)
    return {key: loaded[key] for key in wanted}


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The norm of `actual - expected` relative to the norm of `expected` (absolute where that is 0)."""
    norm = expected.norm().item()
    return (actual - expected).norm().item() / (norm if norm else 1.0)


def _initial_adapter(key: str, shape: tuple) -> torch.Tensor:
    """The logical init of an adapter tensor (`lora.init`, default configuration at LORA_RANK). A stacked key
    (`decoder.layers.<module>`) has the layer on axis 0; a key naming its layer (a stack of unlike layers, as
    DeepSeek's leading dense layers make) has none. Expert tensors have the expert on the next axis."""
    module, factor = key.rsplit(".lora.", 1)
    config = LoraConfig(rank=LORA_RANK)
    in_features, out_features = (shape[-1], 1) if factor == "A" else (1, shape[-2])

    def init(name, expert):
        return logical_factors(config, name, expert, in_features, out_features)[0 if factor == "A" else 1]

    def one_layer(name: str, experts: bool) -> torch.Tensor:
        if not experts:
            return init(name, None)
        # the stacked key's expert path differs between versions; the layer and the linear's name do not
        layer, linear = name.split(".")[2], name.rsplit(".", 1)[1]
        names = [f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{linear}" for e in range(shape[-3])]
        return torch.stack([init(expert, e) for e, expert in enumerate(names)])

    if re.match(r"decoder\.layers\.\d+\.", module):
        return one_layer(module, experts=len(shape) == 3)
    layers = [module.replace("decoder.layers.", f"decoder.layers.{layer}.", 1) for layer in range(shape[0])]
    return torch.stack([one_layer(name, experts=len(shape) == 4) for name in layers])


def _deltas(tensors: dict) -> dict:
    """Adapter tensor -> its change from the logical init (what training did)."""
    return {key: value - _initial_adapter(key, tuple(value.shape)) for key, value in tensors.items() if ".lora." in key}


def export_matches_megatron(root: pathlib.Path, checkpoint: pathlib.Path, base: pathlib.Path) -> None:
    """`megatron-lora-patch export` of `checkpoint` (a --save directory) loads in peft onto the base
    weights of `base` and gives Megatron's logits (and not the base's)."""
    import hf_llama
    import loop_worker
    import persistence_worker
    from peft import PeftModel

    peft_dir = root / f"peft-{checkpoint.name}"
    command = [
        sys.executable,
        "-m",
        "megatron_lora_patch",
        "export",
        "--checkpoint",
        str(checkpoint),
        "--out",
        str(peft_dir),
    ]
    done = subprocess.run(command, cwd=str(root), capture_output=True, text=True, env=clean_environ())
    assert done.returncode == 0, done.stderr
    weights = loop_worker.testbed_weights(_model_tensors(base), SPEC)
    (megatron,) = run_world(
        loop_worker.logits_world,
        1,
        args=(SPEC, weights, checkpoint_source.resolve(str(checkpoint)), LORA_RANK),
        name="tp1",
    )
    tokens, _ = persistence_worker.batch(SPEC)
    base_model = hf_llama.llama_for(SPEC, 0, weights)
    with torch.no_grad():
        base_logits = base_model(tokens).logits
        peft_logits = PeftModel.from_pretrained(base_model, str(peft_dir)).eval()(tokens).logits
    tolerance = 1e-5  # max-abs error relative to the largest logit, fp32 (as tests/test_persistence_peft.py)
    assert ((peft_logits - megatron).abs().max() / megatron.abs().max()).item() <= tolerance
    assert ((base_logits - megatron).abs().max() / megatron.abs().max()).item() > 100 * tolerance
