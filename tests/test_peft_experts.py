"""Expert adapters in PEFT's `target_parameters` layout (lora/exchange/experts.py), without a world.

The logical init of an MoE testbed's adapters (distinct per expert; experts at rank 2 and the
experts' fc2 at alpha 4 through rank / alpha patterns) goes through `to_peft`; `peft` loads the
result into a `MixtralForCausalLM`, and each layer's `ParamWrapper` delta (peft's own code) must
equal `scaling * B_e @ A_e` of every expert e (negative control: experts 0 and 1 exchanged).
`from_peft` inverts `to_peft` bitwise; what the layout cannot hold is refused in one line.
"""

from __future__ import annotations

import persistence_worker as worker
import pytest
import torch
from error_metrics import fp32_sum_tolerance, relative_l2_error

from megatron_lora_patch.lora.exchange import files, peft
from megatron_lora_patch.lora.exchange.names import PeftFormatError
from megatron_lora_patch.proof.testbed.models import DEFAULT_SEED, TinyGPTSpec

SPEC = TinyGPTSpec.moe(moe_ffn_hidden_size=32)
CONFIG = worker.lora_config(5, rank_pattern={"*local_experts*": 2}, alpha_pattern={"*local_experts*linear_fc2": 4.0})
DESCRIPTION = {
    **CONFIG.description(),
    "format": 1,
    "num_layers": SPEC.num_layers,
    "hidden_size": SPEC.hidden_size,
    "num_attention_heads": SPEC.num_attention_heads,
    "num_query_groups": SPEC.num_query_groups,
    "kv_channels": SPEC.kv_channels,
    "gated_linear_unit": True,
    "num_experts": SPEC.num_experts,
}
EXPERTS = "base_model.model.model.layers.0.mlp.experts"


def _expert_deltas(layer: int, linear: str, order=None) -> torch.Tensor:
    """[E, out, in]: scaling * B_e @ A_e of the logical init, experts in `order`."""
    logical = worker.expected_logical(SPEC, CONFIG)
    names = [
        f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{linear}" for e in (order or range(SPEC.num_experts))
    ]
    return torch.stack([CONFIG.scale_for(name) * logical[name][1] @ logical[name][0] for name in names])


def test_peft_param_wrapper_deltas_are_the_megatron_expert_deltas(tmp_path):
    import hf_llama
    from peft import PeftModel

    tensors, config = peft.to_peft(worker.expected_logical(SPEC, CONFIG), DESCRIPTION, "mixtral")
    assert config["rank_pattern"] == {"down_proj": 2, "gate_up_proj": 2} and config["alpha_pattern"] == {
        "down_proj": 4.0
    }
    files.write(str(tmp_path), tensors, config, "mixtral")
    model = PeftModel.from_pretrained(hf_llama.mixtral_for(SPEC, DEFAULT_SEED), str(tmp_path))
    tolerance = fp32_sum_tolerance(2)  # each delta entry sums r = 2 products
    for layer in range(SPEC.num_layers):
        down = model.base_model.model.model.layers[layer].mlp.experts  # peft nests: down_proj outside
        for wrapper, linear in ((down.base_layer, "linear_fc1"), (down, "linear_fc2")):
            delta = wrapper.get_delta_weight("default")
            assert relative_l2_error(delta, _expert_deltas(layer, linear)) <= tolerance, (layer, linear)
            swapped = _expert_deltas(layer, linear, order=[1, 0, 2, 3])
            assert relative_l2_error(delta, swapped) > 100 * tolerance


def test_expert_adapter_written_by_peft_imports_with_its_deltas(tmp_path):
    """An adapter `peft` itself trained-and-saved (random B; no family file, so `read` says llama)
    imports; Megatron's `scaling * B_e @ A_e` of each expert equals peft's delta."""
    import hf_llama
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    settings = PeftLoraConfig(r=2, lora_alpha=8, target_modules=[], target_parameters=targets, init_lora_weights=False)
    model = get_peft_model(hf_llama.mixtral_for(SPEC, DEFAULT_SEED), settings)
    model.save_pretrained(str(tmp_path))
    tensors, config, family = files.read(str(tmp_path))
    description = dict(DESCRIPTION, rank=2, alpha=8.0, rank_pattern=[], alpha_pattern=[])
    expected = [name for name in worker.adapter_names(SPEC) if ".experts." in name]
    logical = peft.from_peft(tensors, config, description, expected, family=family)
    assert family == "llama" and set(logical) == set(expected)
    for layer in range(SPEC.num_layers):
        down = model.base_model.model.model.layers[layer].mlp.experts
        for wrapper, linear in ((down.base_layer, "linear_fc1"), (down, "linear_fc2")):
            names = [f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{linear}" for e in range(SPEC.num_experts)]
            ours = torch.stack([4.0 * logical[name][1] @ logical[name][0] for name in names])  # alpha / r = 8 / 2
            with torch.no_grad():
                delta = wrapper.get_delta_weight("default")
            assert relative_l2_error(ours, delta) <= fp32_sum_tolerance(2), (layer, linear)
            assert relative_l2_error(ours[[1, 0, 2, 3]], delta) > 100 * fp32_sum_tolerance(2)  # experts swapped


def test_round_trip_is_exact_and_family_names_are_shared():
    logical = worker.expected_logical(SPEC, CONFIG)
    tensors, config = peft.to_peft(logical, DESCRIPTION, "qwen3_moe")
    mixtral_tensors, mixtral_config = peft.to_peft(logical, DESCRIPTION, "mixtral")
    assert mixtral_config == config and mixtral_tensors.keys() == tensors.keys()
    assert f"{EXPERTS}.base_layer.lora_A.weight" in tensors and tuple(tensors[f"{EXPERTS}.lora_B.weight"].shape) == (
        64,
        8,
    )
    restored = peft.from_peft(tensors, config, DESCRIPTION, logical, family="qwen3_moe")
    assert set(restored) == set(logical)
    assert all(torch.equal(restored[name][i], logical[name][i]) for name in logical for i in (0, 1))


def _refused(call, *fragments):
    with pytest.raises(PeftFormatError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and all(fragment in message for fragment in fragments), message


def test_what_the_layout_cannot_hold_is_refused():
    logical = worker.expected_logical(SPEC, CONFIG)
    _refused(lambda: peft.to_peft(logical, DESCRIPTION, "llama"), "'llama' has no MoE experts", "--family qwen3_moe")
    partial = {name: pair for name, pair in logical.items() if "local_experts.3.linear_fc2" not in name}
    _refused(lambda: peft.to_peft(partial, DESCRIPTION, "mixtral"), "experts [0, 1, 2] only", "all 4 experts")
    uneven = dict(DESCRIPTION, alpha_pattern=[["*local_experts.0.*", 3.0]])
    _refused(lambda: peft.to_peft(logical, uneven, "mixtral"), "mlp.experts.gate_up_proj", "one per layer")
    tensors, config = peft.to_peft(logical, DESCRIPTION, "mixtral")
    short = dict(tensors, **{f"{EXPERTS}.lora_A.weight": tensors[f"{EXPERTS}.lora_A.weight"][:-1]})
    _refused(
        lambda: peft.from_peft(short, config, DESCRIPTION, logical, family="mixtral"),
        f"{EXPERTS[len(peft.PEFT_PREFIX) :]}",
        "rank 2",
    )
    missing = {key: value for key, value in tensors.items() if not key.startswith(f"{EXPERTS}.base_layer.")}
    _refused(
        lambda: peft.from_peft(missing, config, DESCRIPTION, logical, family="mixtral"), "missing", "base_layer.lora_A"
    )
    other_rank = dict(config, rank_pattern={"gate_up_proj": 2})  # down_proj back at r=4: not the model's rank 2
    _refused(lambda: peft.from_peft(tensors, other_rank, DESCRIPTION, logical, family="mixtral"), "r=4", "rank 2")
