"""Resume equivalence: save model + optimizer on TP2 mid-run, resume on PP2, the next step matches.

The TP2 run trains steps 0-2 and saves a full distributed checkpoint (base, adapters,
Adam state) before step 2. The PP2 run builds adapters from another seed, loads the
checkpoint (its adapters must equal the saved ones bitwise) and trains step 2; its
adapters must equal the uninterrupted TP2 run's (fp32, different reduction order).
Resuming without the optimizer state misses by orders of magnitude more.
"""

from __future__ import annotations

import persistence_worker
import resume_worker
import torch
from error_metrics import relative_l2_error

from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec

SPEC = TinyGPTSpec()
#: relative L2 per factor after one more Adam step on another topology: measured <= 8.4e-8 under three reduction
#: orders (docs/testing.md "Tolerances"); the control without the optimizer state misses by 0.147
TOLERANCE = 1e-5


def _errors(actual, expected) -> dict:
    return {
        f"{name}.{'AB'[i]}": relative_l2_error(actual[name][i], expected[name][i]) for name in expected for i in (0, 1)
    }


def test_resume_on_another_topology_equals_uninterrupted_run(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    reference = run_world(
        resume_worker.train_world,
        2,
        name="tp2",
        timeout=300,
        args=("tp2", SPEC, 5, range(0, 3)),
        kwargs=dict(save_dir=str(checkpoint), save_before=2),
    )
    saved = persistence_worker.assemble([rank["saved"] for rank in reference])
    assert set(saved) == set(persistence_worker.adapter_names(SPEC)), sorted(saved)
    uninterrupted = persistence_worker.assemble([rank["end"] for rank in reference])
    for load_optimizer in (True, False):
        resumed = run_world(
            resume_worker.train_world,
            2,
            name="pp2",
            timeout=300,
            args=("pp2", SPEC, 999, range(2, 3)),
            kwargs=dict(load_dir=str(checkpoint), load_optimizer=load_optimizer),
        )
        loaded = persistence_worker.assemble([rank["start"] for rank in resumed])
        assert set(loaded) == set(saved) and all(all(map(torch.equal, loaded[n], saved[n])) for n in saved)
        errors = _errors(persistence_worker.assemble([rank["end"] for rank in resumed]), uninterrupted)
        print(f"resumed on pp2, optimizer state {'loaded' if load_optimizer else 'dropped'}: worst factor "
              f"{max(errors.values()):.2e}")
        if load_optimizer:
            assert max(errors.values()) <= TOLERANCE, errors
        else:
            assert max(errors.values()) > 100 * TOLERANCE, errors
