"""DoRA training equals transformers + peft's `use_dora` (issue 37, item 3): a few steps at TP2 and DP2.

The harness of tests/hf_training_parity.py on unpacked SFT rows (`data.make_global_batch`: prompt prefixes and
holes masked, valid tokens unequal per row): Megatron with `MEGATRON_LORA_DORA` (the testbed's `dora` option,
separate projections as peft has them) at TP2 (the magnitudes of row-parallel layers replicated, their norms summed
over TP) and at DP2; peft's Llama with `use_dora=True` from the same A, B and magnitudes (copied across), the masked
token losses of the global batch over its valid-token count. Per step the loss and every adapter tensor, the
magnitudes included, must agree; a reference normalized per row (local normalization) must be far off.
"""

from __future__ import annotations

import pytest
import torch
from hf_training_parity import ParitySetup, assert_every_step_within, errors, run_megatron, run_peft

from megatron_lora_patch.proof.testbed.data import make_global_batch
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec

SETUP = ParitySetup(spec=TinyGPTSpec(), lora_options=(("dora", True),))
TOPOLOGIES = ("tp2", "dp2")
#: fp32 in another summation order (TP partial sums, DP sums, HF vs Megatron kernels), at TP2 and DP2 over the 3
#: steps: loss <= 9.9e-8 relative, all adapters (magnitudes included) <= 6.3e-7 relative L2; 3x to 5x margin.
LOSS_TOLERANCE = 5e-7
ADAPTER_TOLERANCE = 2e-6


def _row_losses(model, step: int) -> list:
    """(masked loss sum, valid tokens) of every row of step `step`'s global batch, each row its own forward."""
    spec = SETUP.spec
    batch = make_global_batch(SETUP.seed + step, SETUP.global_batch_size, spec.seq_length, spec.vocab_size)
    pieces = []
    for row in range(SETUP.global_batch_size):
        logits = model(input_ids=batch["tokens"][row : row + 1]).logits[0]
        losses = torch.nn.functional.cross_entropy(logits, batch["labels"][row], reduction="none")
        pieces.append(((losses * batch["loss_mask"][row]).sum(), batch["loss_mask"][row].sum()))
    return pieces


def global_loss(model, step: int) -> torch.Tensor:
    pieces = _row_losses(model, step)
    return sum(loss for loss, _ in pieces) / sum(count for _, count in pieces)


def row_mean_loss(model, step: int) -> torch.Tensor:
    """Control: local normalization, the mean of each row's token mean."""
    pieces = _row_losses(model, step)
    return sum(loss / count for loss, count in pieces) / len(pieces)


@pytest.fixture(scope="module")
def megatron() -> dict:
    return run_megatron(SETUP, TOPOLOGIES)


@pytest.fixture(scope="module")
def initial(megatron) -> dict:
    """DP2's (each rank computes every magnitude whole); TP2's magnitudes of row-parallel layers are norms summed
    over TP, equal up to rounding."""
    dp2, tp2 = megatron["dp2"]["initial"], megatron["tp2"]["initial"]
    start = errors({"losses": [1.0], "adapters": [dp2]}, {"losses": [1.0], "adapters": [tp2]})[0]
    print("initial tp2 vs dp2", start)
    assert start["adapters"] <= ADAPTER_TOLERANCE / 10, start
    assert sum("lora_magnitude_vector" in name for name in dp2) == 7 * SETUP.spec.num_layers
    return dp2


@pytest.fixture(scope="module")
def reference(initial) -> dict:
    return run_peft(SETUP, initial, global_loss)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_dora_training_matches_peft(megatron, reference, topology):
    assert_every_step_within(reference, megatron[topology], SETUP.steps, LOSS_TOLERANCE, ADAPTER_TOLERANCE, topology)


def test_the_magnitudes_train_and_a_local_normalization_is_far_off(megatron, initial, reference):
    for name, tensor in reference["adapters"][-1].items():
        if "lora_magnitude_vector" in name:
            assert float((tensor - initial[name]).norm() / initial[name].norm()) > 100 * ADAPTER_TOLERANCE, name
    wrong = errors(run_peft(SETUP, initial, row_mean_loss), megatron[TOPOLOGIES[0]])
    print("row_mean_loss", wrong)  # measured: 4.5e-3 (loss), 2.4e-2 (adapters) after the first step
    assert wrong[0]["loss"] > 100 * LOSS_TOLERANCE and wrong[0]["adapters"] > 100 * ADAPTER_TOLERANCE, wrong
