"""DoRA (MEGATRON_LORA_DORA, PEFT's use_dora) on real Megatron Column/RowParallelLinear equals PEFT's math.

tests/dora_worker.py compares outputs, input grads and the A, B, m grads of every rank with
`m / ||W + s B A||.detach() * (x W^T + s x A^T B^T) + b` on the logical tensors (fp32, max-abs error over
max below 1e-5; measured <= 2e-7), and `m` as set from the loaded weights with the logical norm. That the
row-parallel norm left local, `m` out of the grad sync or the norm not detached are caught is the oracle's
(mutations `dora_*`, tests/test_oracle_mutations.py).
"""

from __future__ import annotations

import dora_worker
from error_metrics import assert_errors_within

from megatron_lora_patch.proof.testbed.launcher import run_world

TOLERANCE = 1e-5
EXPECTED = [f"{layer}.{what}" for layer in ("fc1", "fc2") for what in ("m_init", "y", "dx", "dA", "dB", "dm")]


def test_dora_layers_match_peft_math():
    """tp2-sp: column rows local, row sums over TP, the sequence gathered and scattered (SP): every rule at once."""
    results = run_world(dora_worker.check_dora_layers, 2, args=("tp2-sp",), name="tp2-sp", timeout=240)
    for rank, errors in enumerate(results):
        assert_errors_within(errors, EXPECTED, TOLERANCE, f"tp2-sp rank {rank}")


def test_m_follows_the_base_load_and_the_adapter_checkpoint(tmp_path):
    """m from a base checkpoint's weights (not the model's init), then the saved m from adapters (tp2)."""
    import dora_checkpoint_worker

    from megatron_lora_patch.proof.testbed.models import TinyGPTSpec

    errors = run_world(dora_checkpoint_worker.base_then_adapters_world, 2, args=("tp2", TinyGPTSpec(), str(tmp_path)),
                       name="tp2", timeout=300)[0]
    assert errors["m_before_load_vs_base_norm"] > 100 * TOLERANCE, errors  # other base weights: another m
    for key in ("m_after_base_load", "m_after_adapter_load", "logits"):
        assert errors[key] < TOLERANCE, errors
