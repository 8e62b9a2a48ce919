"""In-memory PEFT hand-off (`megatron_lora_patch.handoff.adapter_state`), checked against the on-disk export
and against `transformers` + `peft`.

At each topology a model with non-zero adapters takes `adapter_state` (gathered to rank 0, its
torch.distributed traffic counted) and then writes an adapter-only checkpoint; the checkpoint's
`export_peft` is the reference: the in-memory state written with `files.write` must give the same bytes.
TP2 (dense + a fully trained output layer), PP2 (tied embeddings trained fully: two copies on two
stages), EP2 (Qwen3-MoE) and TP2 + ETP2 + SP (Mixtral). On one-stage topologies `peft.get_peft_model`
+ `set_peft_model_state_dict` loads the tensors into the HF model, whose logits must equal Megatron's
(fp32, 1e-5 of the largest logit, as the export tests); negative controls: the base model alone, and
the same state with `lora_alpha` doubled. Traffic: only `send` / `recv` of adapter shards to rank 0
plus the metadata exchange; every byte sent is received by rank 0 and the total is at most the logical
adapter size.
"""

from __future__ import annotations

import dataclasses
import os

import handoff_worker
import persistence_worker
import pytest
import torch
from error_metrics import max_abs_error_over_max

from megatron_lora_patch.lora.exchange import files as peft_files
from megatron_lora_patch.lora.exchange import names as peft_names
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import DEFAULT_SEED, TinyGPTSpec

LOGITS_TOLERANCE = 1e-5
SEED = 31
METADATA_BOUND = 64 * 1024  # bytes of the one all_gather_object of names and shapes (2-rank worlds)
MOE = TinyGPTSpec.moe(moe_ffn_hidden_size=32)
#: case -> (topology, spec, HF family, LoraConfig options)
CASES = {
    "tp2": ("tp2", TinyGPTSpec(), "llama", {"modules_to_save": ("output_layer",)}),
    "pp2-tied": ("pp2", TinyGPTSpec(tie_embeddings=True), "llama", {"modules_to_save": ("output_layer",)}),
    "ep2": ("ep2", dataclasses.replace(MOE, qk_layernorm=True), "qwen3_moe", {}),
    "tp2-etp2-sp": ("tp2-etp2-sp", MOE, "mixtral", {}),
}


@pytest.fixture(scope="module", params=list(CASES))
def handed(request, tmp_path_factory):
    from megatron_lora_patch.lora.exchange.transfer import export_peft

    topology, spec, family, options = CASES[request.param]
    root = tmp_path_factory.mktemp(f"handoff-{request.param}")
    checkpoint = str(root / "checkpoint")
    ranks = run_world(handoff_worker.state_world, 2, args=(topology, spec, SEED, checkpoint, family, options),
                      name=topology, timeout=300)
    export_peft(checkpoint, str(root / "export"), family)
    return {"root": root, "ranks": ranks, "spec": spec, "family": family, "options": options}


def _read(directory) -> dict:
    names = (peft_names.WEIGHTS_NAME, peft_names.CONFIG_NAME, peft_names.METADATA_NAME)
    return {name: open(os.path.join(directory, name), "rb").read() for name in names}


def test_in_memory_state_is_the_on_disk_export_byte_for_byte(handed):
    first, second = handed["ranks"]
    assert first["config"] == second["config"] and second["tensors"] == {} and first["tensors"]
    peft_files.write(str(handed["root"] / "memory"), first["tensors"], first["config"], handed["family"])
    assert _read(handed["root"] / "memory") == _read(handed["root"] / "export")


def _logical_bytes(spec, options) -> int:
    """Bytes of the logical adapters (from the spec and LoraConfig alone) and the fully trained weight."""
    logical = persistence_worker.expected_logical(spec, persistence_worker.lora_config(SEED, **options))
    adapters = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in logical.values())
    return adapters + (spec.vocab_size * spec.hidden_size * 4 if options.get("modules_to_save") else 0)


def test_traffic_is_adapter_shards_to_rank_zero_only(handed):
    calls = [rank["calls"] for rank in handed["ranks"]]
    operations = {name for rank in calls for name, _ in rank}
    assert operations <= {"send", "recv", "all_gather"}, operations
    sent = sum(size for rank in calls for name, size in rank if name == "send")
    received = sum(size for name, size in calls[0] if name == "recv")
    metadata = sum(size for rank in calls for name, size in rank if name == "all_gather")
    assert not [name for name, _ in calls[0] if name == "send"] and sent == received > 0
    logical = _logical_bytes(handed["spec"], handed["options"])
    print(f"sent {sent} B (logical adapter {logical} B, base weights {handed['ranks'][1]['base_bytes']} B on "
          f"rank 1), metadata {metadata} B")
    assert sent <= logical and metadata <= METADATA_BOUND


def _hf_model(handed):
    import hf_llama

    build = {"llama": hf_llama.llama_for, "qwen3_moe": hf_llama.qwen3_moe_for, "mixtral": hf_llama.mixtral_for}
    return build[handed["family"]](handed["spec"], DEFAULT_SEED)


def _peft_logits(handed, config: dict) -> torch.Tensor:
    from peft import PeftConfig, get_peft_model, set_peft_model_state_dict

    model = get_peft_model(_hf_model(handed), PeftConfig.from_peft_type(**config))
    result = set_peft_model_state_dict(model, handed["ranks"][0]["tensors"])
    assert not result.unexpected_keys, result.unexpected_keys
    with torch.no_grad():
        return model.eval()(persistence_worker.batch(handed["spec"])[0]).logits


@pytest.mark.parametrize("handed", [case for case, (topology, *_) in CASES.items() if "pp" not in topology],
                         indirect=True)
def test_set_peft_model_state_dict_gives_megatron_logits(handed):
    """One-stage cases (under PP the logits live on two stages; the bytes test covers PP2)."""
    megatron = handed["ranks"][0]["logits"]
    config = handed["ranks"][0]["config"]
    error = max_abs_error_over_max(_peft_logits(handed, config), megatron)
    print(f"peft ({handed['family']}) vs Megatron logits: max-abs / max = {error:.3e}")
    assert error <= LOGITS_TOLERANCE
    with torch.no_grad():
        base = _hf_model(handed)(persistence_worker.batch(handed["spec"])[0]).logits
    assert max_abs_error_over_max(base, megatron) > 100 * LOGITS_TOLERANCE
    doubled = {**config, "lora_alpha": 2 * config["lora_alpha"]}
    assert max_abs_error_over_max(_peft_logits(handed, doubled), megatron) > 100 * LOGITS_TOLERANCE


def test_stream_yields_one_layer_at_a_time(handed):
    """`stream` gives rank 0 one transformer layer's tensors per step (then the fully trained weights),
    the same tensors `adapter_state` gathers; the other rank gets the same units, empty."""
    first, second = handed["ranks"]
    layers = handed["spec"].num_layers
    units = [f"decoder.layers.{layer}" for layer in range(layers)]
    units += ["modules_to_save"] if handed["options"].get("modules_to_save") else []
    assert [unit for unit, _ in first["units"]] == [unit for unit, _ in second["units"]] == units
    assert all(names == [] for _, names in second["units"])
    for layer, (_, names) in enumerate(first["units"][:layers]):
        assert names and all(f".layers.{layer}." in name for name in names)
    assert sorted(name for _, names in first["units"] for name in names) == sorted(first["tensors"])
