"""Parent side of the driver: run `train_steps` on a topology and merge the ranks into world-1 layout.

`run_topology(spec, "tp2-sp", settings)` launches one gloo world (`launcher.run_world`),
each rank running `driver.train_steps` inside `Topology.world()`; `run_jobs` runs many
(spec, topology, settings) jobs, sharing processes between jobs of the same world size.
`canonical_result` turns the per-rank records into the layout of the world-size-1 run (logical parameter
names and full tensors via `testbed.shards`, microbatch losses in global order), so a
topology and the reference compare key by key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Union

import torch

from megatron_lora_patch.proof.testbed.data import num_microbatches_for
from megatron_lora_patch.proof.testbed.driver import train_steps
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.settings import TrainSettings
from megatron_lora_patch.proof.testbed.topology import Topology

DEFAULT_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Job:
    """One training run: a model spec on a topology with its settings.

    `context`: a picklable callable returning a context manager that each rank enters
    around the run, after Megatron's setup and before the model is built (the oracle
    applies its patches and mutations there).
    """

    spec: Any
    topology: Topology
    settings: TrainSettings = TrainSettings()
    context: Optional[Callable[[], ContextManager]] = None

    def __post_init__(self) -> None:
        if isinstance(self.topology, str):
            object.__setattr__(self, "topology", Topology.parse(self.topology))
        from megatron_lora_patch.proof.testbed.models import check_topology_fits

        # A spec may validate topologies itself (the preflight's model: Megatron-LM's validate_args did).
        check = getattr(self.spec, "check_topology", None)
        check(self.topology) if check is not None else check_topology_fits(self.spec, self.topology)
        num_microbatches_for(self.settings.global_batch_size, self.settings.micro_batch_size, self.topology.dp)


def _import_training_modules() -> None:
    """Import what a run imports on first use (model, DDP, optimizer, schedules) before any job's
    clock starts: otherwise the first job of each world is charged the world's imports (seconds)."""
    import importlib

    for name in (
        "megatron.core.models.gpt",
        "megatron.core.models.gpt.gpt_layer_specs",
        "megatron.core.distributed",
        "megatron.core.optimizer",
        "megatron.core.pipeline_parallel",
        "megatron.core.transformer.module",
    ):
        importlib.import_module(name)


def _train_jobs_on_rank(rank: int, world_size: int, jobs: List[Job]) -> List[dict]:
    """Every job in turn, each in its own gloo world + Megatron setup (imports are paid once).

    Each record gets `wall_s`: the job's seconds in this rank (world setup and training;
    process start and imports, shared by the world's jobs, are not counted)."""
    _import_training_modules()
    records = []
    for index, job in enumerate(jobs):
        started = time.monotonic()
        try:
            world = job.topology.world(seed=job.settings.seed, device=job.settings.device)
            with world, (job.context or contextlib.nullcontext)():
                records.append(train_steps(job.spec, job.topology, job.settings))
            records[-1]["wall_s"] = time.monotonic() - started
        except Exception as error:
            if hasattr(error, "add_note"):  # Python 3.11+: name the failing job in the rank's traceback
                error.add_note(f"in job {index} of this world: topology {job.topology}, spec {job.spec}")
            raise
    return records


def run_jobs(jobs: Sequence[Job], *, timeout: float = DEFAULT_TIMEOUT_S, warnings: str = "default") -> List[List[dict]]:
    """Run every job; return each job's rank records (rank order), in job order.

    Jobs of the same world size run one after another in one set of processes, so a
    test matrix pays process start and `import megatron` once per world size. Each job
    gets a fresh process group and `parallel_state`, like a fresh launch. `warnings`: the
    ranks' warnings filter action (`launcher.run_world`).
    """
    jobs = list(jobs)
    results: List[Optional[List[dict]]] = [None] * len(jobs)
    by_world: Dict[int, List[int]] = {}
    for index, job in enumerate(jobs):
        by_world.setdefault(job.topology.world_size, []).append(index)
    for world_size, indices in by_world.items():
        group = [jobs[index] for index in indices]
        per_rank = run_world(
            _train_jobs_on_rank,
            world_size,
            args=(group,),
            timeout=timeout,
            name=",".join(str(job.topology) for job in group),
            warnings=warnings,
        )
        for position, index in enumerate(indices):
            results[index] = [rank_records[position] for rank_records in per_rank]
    return results


def run_topology(
    spec,
    topology: Union[str, Topology],
    settings: TrainSettings = TrainSettings(),
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> List[dict]:
    """Run `settings.steps` training steps of `spec` on `topology`; return the rank records in rank order."""
    return run_jobs([Job(spec, topology, settings)], timeout=timeout)[0]


def _assemble(
    records: List[dict], phase: str, step: Optional[int], shapes: Dict[str, tuple]
) -> Dict[str, torch.Tensor]:
    """Logical tensors of one captured phase ('grads', 'params', 'initial_params') from every rank."""
    from megatron_lora_patch.proof.testbed.shards import assemble_logical

    rank_items = []
    for record in records:
        tensors = record[phase] if step is None else record["steps"][step][phase]
        rank_items.append([(record["shards"][name], tensor.float()) for name, tensor in tensors.items()])
    present = {shard.logical_name for items in rank_items for shard, _ in items}
    missing = present - set(shapes)
    if missing:
        raise KeyError(
            f"captured parameters {sorted(missing)} have no logical shape; pass shapes= covering them "
            "(e.g. logical_shapes(spec) extended with adapter shapes)"
        )
    return assemble_logical(rank_items, {name: shapes[name] for name in present})


def _global_microbatches(records: List[dict], step: int) -> List[dict]:
    """Per-microbatch losses in world-1 order, CP partial sums added, one TP replica read.

    MegatronPretrainingSampler order: microbatch m of DP rank r is global microbatch m*dp + r.
    """
    merged: Dict[int, Dict[str, float]] = {}
    for record in records:
        coords = record["coords"]
        if not record["is_last_stage"] or coords["tp_rank"] != 0:
            continue
        for local_index, entry in enumerate(record["steps"][step]["microbatches"]):
            global_index = local_index * coords["dp_size"] + coords["dp_rank"]
            slot = merged.setdefault(global_index, {key: 0 for key in entry})
            for key, value in entry.items():
                slot[key] += value
    return [merged[index] for index in sorted(merged)]


def _first_value(records: List[dict], step: int, key: str) -> Any:
    for record in records:
        value = record["steps"][step][key]
        if value is not None:
            return value
    return None


def canonical_result(records: List[dict], spec, shapes: Optional[Dict[str, tuple]] = None) -> dict:
    """Merge rank records into the world-1 layout.

    Returns {'initial_params': {logical name: tensor}, 'steps': [{'microbatches',
    'lm_loss', 'grad_norm', 'grads', 'params'}]}; tensors are fp32, full logical shape.
    `shapes` defaults to `models.logical_shapes(spec)`. Forward captures stay per rank
    (their sharding depends on the module; the oracle canonicalizes them).
    """
    from megatron_lora_patch.proof.testbed.models import logical_shapes

    shapes = shapes if shapes is not None else logical_shapes(spec)
    steps = []
    for step in range(len(records[0]["steps"])):
        steps.append(
            {
                "microbatches": _global_microbatches(records, step),
                "lm_loss": _first_value(records, step, "lm_loss"),
                "grad_norm": _first_value(records, step, "grad_norm"),
                "grads": _assemble(records, "grads", step, shapes),
                "params": _assemble(records, "params", step, shapes),
            }
        )
    return {"initial_params": _assemble(records, "initial_params", None, shapes), "steps": steps}
