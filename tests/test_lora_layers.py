"""LoRA on real Megatron Column/RowParallelLinear (gloo, CPU) equals the dense world-size-1 math.

Forward outputs, input grads and A / B grads of every rank are compared with
`x W^T + b + s x A^T B^T` recomputed densely from the logical tensors (fp32: max-abs
error relative to the reference's largest magnitude below 1e-6; measured <= ~3e-7).
"""

from __future__ import annotations

import lora_layer_worker
import pytest
from error_metrics import assert_errors_within

from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.topology import Topology

TOLERANCE = 1e-6

CASES = [
    ("tp1", False, "keep"),
    ("tp2", False, "keep"),
    ("tp2-sp", False, "keep"),
    ("tp2-sp", False, "regather"),
    ("ep2", True, "keep"),
    ("etp2", True, "keep"),
]


@pytest.mark.parametrize("topology, expert, sp_input", CASES)
def test_wrapped_layers_match_dense_recompute(topology, expert, sp_input):
    world = Topology.parse(topology).world_size
    results = run_world(
        lora_layer_worker.check_layers, world, args=(topology, expert, sp_input), name=topology, timeout=240
    )
    expected = [f"{layer}.{what}" for layer in ("fc1", "fc2") for what in ("y", "dx", "dA", "dB", "A_init", "B_init")]
    for rank, errors in enumerate(results):
        assert_errors_within(errors, expected, TOLERANCE, f"{topology} rank {rank}")
