"""Adapter-only distributed checkpoints reshard across topologies, bitwise.

Every topology saves a checkpoint of adapters drawn from its own seed; every topology
then loads every checkpoint into adapters of a different seed and the assembled logical
adapters must equal the saved logical init exactly (torch.equal). Without the
`lora_checkpoint` patch the sharded factors are saved as if replicated, which fails
either the save (inconsistent global shapes) or the comparison.
"""

from __future__ import annotations

import persistence_worker as worker
import pytest
import torch

from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec
from megatron_lora_patch.proof.testbed.topology import Topology

SPEC = TinyGPTSpec.moe(num_layers=2)
FAST = ("tp2", "ep2", "etp2", "pp2")
SLOW = ("tp1", "tp2-dp2", "tp2-pp2", "ep2-etp2", "dp4")


def _matrix(topologies, tmp_path):
    saved = {}
    for index, topology in enumerate(topologies):
        directory = str(tmp_path / f"save-{topology}")
        world = Topology.parse(topology).world_size
        run_world(worker.save_world, world, args=(topology, SPEC, 100 + index, directory), name=topology, timeout=240)
        saved[topology] = (directory, worker.lora_config(100 + index))
    for loader in topologies:
        directories = [saved[t][0] for t in topologies]
        bad = saved[topologies[0]][0] if loader == topologies[0] else None
        results = run_world(
            worker.load_world, Topology.parse(loader).world_size, args=(loader, SPEC, directories, bad),
            name=loader, timeout=300,
        )
        for position, saver in enumerate(topologies):
            logical = worker.assemble([loaded[position] for loaded, _ in results])
            expected = worker.expected_logical(SPEC, saved[saver][1])
            assert len(expected) == SPEC.num_layers * (2 + 2 * SPEC.num_experts)
            where = f"saved on {saver}, loaded on {loader}"
            assert set(logical) == set(expected), f"{where}: {sorted(set(logical) ^ set(expected))}"
            wrong = [name for name in expected if not all(map(torch.equal, logical[name], expected[name]))]
            assert not wrong, f"{where}: {wrong}"
        if bad is not None:
            for _, (rank_error, layout_error) in results:
                assert "\n" not in rank_error and "rank=4" in rank_error and "rank=8" in rank_error, rank_error
                assert "\n" not in layout_error and "MEGATRON_LORA_SEPARATE_PROJECTIONS=0" in layout_error, layout_error


def test_adapter_checkpoint_every_pair(tmp_path):
    _matrix(FAST, tmp_path)


@pytest.mark.slow
def test_adapter_checkpoint_every_pair_four_ranks(tmp_path):
    _matrix(SLOW, tmp_path)
