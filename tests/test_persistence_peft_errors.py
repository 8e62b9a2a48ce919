"""PEFT adapters a fused Megatron adapter cannot express are refused with one line naming the module.

Pure conversions (no world): `to_peft` of random logical adapters gives a valid PEFT
adapter (checked to round-trip exactly), then each test breaks one thing.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lora_patch.lora.exchange import checks, peft
from megatron_lora_patch.lora.exchange.names import PeftFormatError

DESCRIPTION = {
    "format": 1, "rank": 4, "alpha": 8.0, "num_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
    "num_query_groups": 2, "kv_channels": 16, "gated_linear_unit": True, "num_experts": 0,
}
SHAPES = {  # module -> (A shape, B shape) of the logical adapter
    "decoder.layers.0.self_attention.linear_qkv": ((4, 64), (128, 4)),
    "decoder.layers.0.self_attention.linear_proj": ((4, 64), (64, 4)),
    "decoder.layers.0.mlp.linear_fc1": ((4, 64), (256, 4)),
    "decoder.layers.0.mlp.linear_fc2": ((4, 128), (64, 4)),
}
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
K_A = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"
K_B = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
UP_A = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"


def _logical(rank: int = 4):
    generator = torch.Generator().manual_seed(3)
    return {
        name: (torch.randn((rank, a[1]), generator=generator), torch.randn((b[0], rank), generator=generator))
        for name, (a, b) in SHAPES.items()
    }


def _valid():
    return peft.to_peft(_logical(), DESCRIPTION)


def _import(tensors, config):
    logical = peft.from_peft(tensors, config, DESCRIPTION, SHAPES, where="adapter")
    checks.check_shapes(logical, SHAPES, "adapter")
    return logical


def _refused(tensors, config, *fragments):
    with pytest.raises(PeftFormatError) as caught:
        _import(tensors, config)
    message = str(caught.value)
    assert "\n" not in message and all(fragment in message for fragment in fragments), message


def test_valid_adapter_round_trips_exactly():
    tensors, config = _valid()
    assert len(tensors) == 2 * 7
    logical, restored = _logical(), _import(tensors, config)
    assert set(restored) == set(logical) == set(SHAPES), sorted(restored)
    assert all(torch.equal(restored[n][i], logical[n][i]) for n in logical for i in (0, 1))


def test_different_a_for_q_k_v_is_refused():
    tensors, config = _valid()
    tensors[K_A] = tensors[K_A] + 1.0
    _refused(tensors, config, "k_proj", "linear_qkv", "MEGATRON_LORA_SEPARATE_PROJECTIONS=1")


def test_different_a_for_gate_up_is_refused():
    tensors, config = _valid()
    tensors[UP_A] = torch.zeros_like(tensors[UP_A])
    _refused(tensors, config, "up_proj", "linear_fc1")


def test_wrong_shapes_are_refused():
    tensors, config = _valid()
    tensors[K_B] = torch.zeros(20, 4)
    _refused(tensors, config, "k_proj", "linear_qkv")
    tensors, config = _valid()
    for key in [k for k in tensors if ".mlp.down_proj.lora_A" in k]:
        tensors[key] = torch.zeros(4, 100)
    _refused(tensors, config, "linear_fc2", "(4, 128)", "(4, 100)")


def test_missing_key_is_refused():
    tensors, config = _valid()
    del tensors[Q_A]
    _refused(tensors, config, "missing", "q_proj", "linear_qkv")


def test_unsupported_module_is_refused():
    tensors, config = _valid()
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    _refused(tensors, config, "lm_head")


def test_other_rank_alpha_and_variants_are_refused():
    """A true rank-8 adapter for the rank-4 model: the advice to build the model at rank 8 is right."""
    tensors, config = peft.to_peft(_logical(rank=8), {**DESCRIPTION, "rank": 8, "alpha": 16.0})
    _refused(tensors, config, "r=8", "rank 4", "MEGATRON_LORA_RANK=8")
    tensors, config = _valid()
    _refused(tensors, {**config, "lora_alpha": 16}, "lora_alpha=16")
    _refused(tensors, {**config, "use_dora": True}, "use_dora=true", "do not use DoRA", "MEGATRON_LORA_DORA=1")
    _refused(tensors, {**config, "peft_type": "IA3"}, "IA3")


def test_experts_of_a_dense_family_and_unknown_families_are_refused_on_export():
    expert = {"decoder.layers.0.mlp.experts.local_experts.1.linear_fc1": (torch.zeros(4, 64), torch.zeros(256, 4))}
    with pytest.raises(PeftFormatError, match="'llama' has no MoE experts.*--family qwen3_moe or mixtral"):
        peft.to_peft(expert, DESCRIPTION)
    with pytest.raises(PeftFormatError, match="unknown model family 'gpt2'"):
        peft.to_peft(_logical(), DESCRIPTION, family="gpt2")


def test_partial_layers_are_listed_by_full_path():
    two_layers = {**DESCRIPTION, "num_layers": 2}
    _, config = peft.to_peft(_logical(), two_layers)
    assert "model.layers.0.self_attn.q_proj" in config["target_modules"]


def test_config_rank_that_is_not_the_tensors_rank_names_that_mismatch():
    """adapter_config.json says r=2, the tensors are rank 4 (as the model): advising MEGATRON_LORA_RANK=2
    would lead to a second error on the shapes; the message names the config/tensor mismatch instead."""
    tensors, config = _valid()
    with pytest.raises(PeftFormatError) as caught:
        _import(tensors, {**config, "r": 2})
    assert str(caught.value) == (
        "adapter: adapter_config.json gives model.layers.0.self_attn.q_proj r=2 but its lora_A has rank 4 "
        "(shape (4, 64)); the config does not describe its tensors: correct r there or export the adapter again"
    )
    pattern = {**config, "rank_pattern": {"down_proj": 8}}
    with pytest.raises(PeftFormatError, match=r"gives model\.layers\.0\.mlp\.down_proj r=8 but its lora_A has rank 4 "
                       r"\(shape \(4, 128\)\); the config does not describe its tensors: correct rank_pattern there"):
        _import(tensors, pattern)


@pytest.mark.parametrize("damage", ["zero-filled", "truncated"])
def test_unreadable_safetensors_is_one_line_exit_1_in_a_rank(tmp_path, damage):
    """A corrupt adapter_model.safetensors read by import_peft in a training process (its excepthook prints a
    UsageError as one line, exit 1) instead of safetensors' traceback."""
    import subprocess
    import sys

    from conftest import assert_one_line_error, clean_environ

    from megatron_lora_patch.lora.exchange import files

    files.write(str(tmp_path), *_valid())
    weights = tmp_path / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(bytes(len(data)) if damage == "zero-filled" else data[: len(data) // 2])
    code = (
        "from megatron_lora_patch.runtime.errors import install_excepthook; install_excepthook()\n"
        f"from megatron_lora_patch.lora.exchange import files; files.read({str(tmp_path)!r})"
    )
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=clean_environ())
    cause = {
        "zero-filled": "invalid JSON in header: EOF while parsing a value at line 1 column 0",
        "truncated": "incomplete metadata, file not fully covered",
    }[damage]
    message = (
        f"{weights} is not a readable safetensors file (Error while deserializing header: {cause}); "
        "export or copy the adapter again"
    )
    assert_one_line_error(result, message)
