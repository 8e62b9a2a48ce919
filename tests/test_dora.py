"""DoRA (MEGATRON_LORA_DORA, PEFT's use_dora) on real Megatron Column/RowParallelLinear equals PEFT's math.

tests/dora_worker.py compares outputs, input grads and the A, B, m grads of every rank with
`m / ||W + s B A||.detach() * (x W^T + s x A^T B^T) + b` on the logical tensors (fp32, max-abs error over
max below 1e-5), and `m` as set from the loaded weights with the logical norm. Two mutations must fail:
the row-parallel norm left local (not summed over TP) and the norm not detached.
"""

from __future__ import annotations

import dora_worker
import pytest
from error_metrics import assert_errors_within

from megatron_lora_patch.lora.exchange.names import PeftFormatError
from megatron_lora_patch.lora.exchange.transfer import export_peft
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.topology import Topology

TOLERANCE = 1e-5
EXPECTED = [f"{layer}.{what}" for layer in ("fc1", "fc2") for what in ("m_init", "y", "dx", "dA", "dB", "dm")]


def _run(topology: str, mutation: str = "none"):
    world = Topology.parse(topology).world_size
    return run_world(dora_worker.check_dora_layers, world, args=(topology, mutation), name=topology, timeout=240)


@pytest.mark.parametrize("topology", ["tp1", "tp2-sp"])
def test_dora_layers_match_peft_math(topology):
    for rank, errors in enumerate(_run(topology)):
        assert_errors_within(errors, EXPECTED, TOLERANCE, f"{topology} rank {rank}")


@pytest.mark.parametrize("mutation, broken", [
    ("local_row_norm", ("fc2.m_init", "fc2.y")),  # each rank's norm over its own input slice only
    ("norm_with_grad", ("fc1.dA", "fc1.dB", "fc2.dA", "fc2.dB")),  # grads flow through the norm
])
def test_dora_mutations_are_caught(mutation, broken):
    errors = _run("tp2", mutation)[0]
    for key in broken:
        assert errors[key] > 100 * TOLERANCE, (mutation, key, errors[key])


def test_m_follows_the_base_load_and_the_adapter_checkpoint(tmp_path):
    """m from a base checkpoint's weights (not the model's init), then the saved m from adapters (tp2)."""
    import dora_checkpoint_worker

    from megatron_lora_patch.proof.testbed.models import TinyGPTSpec

    errors = run_world(dora_checkpoint_worker.base_then_adapters_world, 2, args=("tp2", TinyGPTSpec(), str(tmp_path)),
                       name="tp2", timeout=300)[0]
    assert errors["m_before_load_vs_base_norm"] > 100 * TOLERANCE, errors  # other base weights: another m
    for key in ("m_after_base_load", "m_after_adapter_load", "logits"):
        assert errors[key] < TOLERANCE, errors
    with pytest.raises(PeftFormatError, match=r"^checkpoint_dir .*adapters: the adapters use DoRA"):
        export_peft(str(tmp_path / "adapters"), str(tmp_path / "peft"))  # not written yet: one line
    assert not (tmp_path / "peft").exists()
