"""The drift locator names where a mismatch starts (the first layer in forward order over its
threshold), then where it is worst: errors grow downstream of a bug, so the largest is usually a
later layer (a qkv-packing bug in layer 0 shows most in a later `linear_fc2`; issue 26)."""

from __future__ import annotations

import torch

from megatron_lora_patch.proof.oracle.metrics import compare_tensors, forward_position
from megatron_lora_patch.proof.oracle.preflight_report import drift, drift_line

KINDS = ["dense", "dense", "dense", "dense"]
NAMES = [f"decoder.layers.{layer}.{module}" for layer in range(4)
         for module in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]


def _phase(errors: dict, threshold: float = 1e-3):
    """Metrics of a phase whose tensors carry the given relative errors (others exact)."""
    expected = {name: torch.ones(8, dtype=torch.float64) for name in NAMES}
    actual = {name: tensor * (1 + errors.get(name, 0.0)) for name, tensor in expected.items()}
    return compare_tensors(actual, expected, threshold)


def test_a_bug_in_layer_0_qkv_is_named_first_though_a_later_fc2_drifts_most():
    forward = _phase({"decoder.layers.0.self_attention.linear_qkv": 2e-3, "decoder.layers.2.mlp.linear_fc1": 5e-2,
                      "decoder.layers.3.mlp.linear_fc2": 4e-1})
    grads = _phase({"decoder.layers.1.mlp.linear_fc2": 9e-1})
    found = drift({"forward": forward, "grads": grads}, KINDS)
    assert found["first"] == {"phase": "forward", "layer": 0, "layer_kind": "dense",
                              "parameter": "decoder.layers.0.self_attention.linear_qkv"}
    assert found["parameter"] == "decoder.layers.1.mlp.linear_fc2" and found["phase"] == "grads"
    line = drift_line(found)
    assert line.startswith("starts at: layer 0 (dense), decoder.layers.0.self_attention.linear_qkv in forward; ")
    assert "drifts most: phase grads" in line


def test_negative_control_tensors_under_the_threshold_are_never_first():
    """An error just under the threshold in layer 0 does not start the drift; the first over it does."""
    forward = _phase({"decoder.layers.0.self_attention.linear_qkv": 9e-4, "decoder.layers.2.mlp.linear_fc1": 5e-2})
    assert forward.first_over == "decoder.layers.2.mlp.linear_fc1"
    assert drift({"forward": forward}, KINDS)["first"]["layer"] == 2


def test_forward_position_orders_layers_then_modules():
    shuffled = sorted(NAMES, key=lambda name: name[::-1])
    assert sorted(shuffled, key=forward_position) == NAMES
    assert forward_position("output_layer.weight") > forward_position("decoder.layers.3.mlp.linear_fc2")


def test_the_bitwise_gate_names_the_first_tensor_that_differs_at_all():
    forward = _phase({"decoder.layers.1.self_attention.linear_proj": 1e-12, "decoder.layers.3.mlp.linear_fc2": 1e-3},
                     threshold=0.0)
    assert forward.first_over == "decoder.layers.1.self_attention.linear_proj"
