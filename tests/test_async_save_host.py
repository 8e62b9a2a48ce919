"""The host's asynchronous checkpoint save against its GPU definition (`cpu_testbed/async_save.py`, S8 and S9).

Megatron-Core's persistent checkpoint worker (what `--async-save` runs) on one gloo rank with `cpu_compat`:
- S8: the worker process starts and writes; without the fix it dies as it selects its GPU (a zero
  `device_count()`), the failure that left Megatron-LM's trainer waiting for ever on CPU.
- S9: the save holds a copy of every tensor, taken before it returns, as a GPU run's device-to-host copy is:
  the trainer changes its weight as soon as the save is scheduled (the next step) and the checkpoint still
  holds the saved values. Without the fix the write plan holds the trainer's own tensor (checked on its
  storage: which values the worker then writes is a race, printed, not asserted).
"""

from __future__ import annotations

import os

import torch

from megatron_lora_patch.proof.testbed.launcher import run_world

ONLY_CPU_COMPAT = {
    "cpu_compat": True,
    "lora_linear": False,
    "lora_checkpoint": False,
    "finalize_grads": False,
    "loss_normalization": False,
}
PLUGINS = "lora_correct,cpu_testbed"


def _apply() -> None:
    """`cpu_compat` here, and in the worker process, which bootstraps from the environment as a run's does."""
    import megatron_lora_patch

    os.environ["MEGATRON_PLUGINS"] = PLUGINS
    megatron_lora_patch.apply(plugins=PLUGINS.split(","), enable=ONLY_CPU_COMPAT, strict=True)


def _sharded(tensor: torch.Tensor) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {"weight": ShardedTensor.from_rank_offsets("weight", tensor, replica_id=0)}


def _save_then_step(directory: str, queue) -> tuple:
    """Save a weight asynchronously, change it in place once the save is scheduled (the next step), finish the
    save; return (whether the write plan held the trainer's own storage, the checkpoint equals the saved values,
    the checkpoint equals the changed ones)."""
    from megatron.core import dist_checkpointing

    os.makedirs(directory)
    weight = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    saved = weight.clone()
    request = dist_checkpointing.save(_sharded(weight), directory, async_sharded_save=True, async_strategy="mcore")
    planned = [tensor for bucket in request.async_fn_args[1] for _, tensor in bucket[2][1]]
    own_storage = any(tensor.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr() for tensor in planned)
    queue.schedule_async_request(request)
    weight.add_(1.0)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
    loaded = dist_checkpointing.load(_sharded(torch.empty_like(weight)), directory)["weight"]
    return own_storage, torch.equal(loaded, saved), torch.equal(loaded, weight)


def save_with_and_without_staging(rank, world_size, root):
    """The round trip through the persistent worker with both fixes, then with S9 taken out."""
    _apply()
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from megatron_lora_patch.lora.checkpoints.source import process_group

    with process_group():
        queue = AsyncCallsQueue(persistent=True)
        staged = _save_then_step(os.path.join(root, "staged"), queue)
        prepare = FileSystemWriterAsync.prepare_write_data
        FileSystemWriterAsync.prepare_write_data = getattr(prepare, "__wrapped__", prepare)  # S9 out, if it was in
        unstaged = _save_then_step(os.path.join(root, "unstaged"), queue)
        queue.close()
    return staged, unstaged


def worker_exit_without_the_device_fix(rank, world_size):
    """S8 taken out: start the worker as `--async-save` does and wait (bounded) for it to die. The worker's
    interpreter must not apply the patch either (it would resolve Megatron's loop to the fixed one)."""
    _apply()
    del os.environ["MEGATRON_PLUGINS"]
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    from megatron_lora_patch.cpu_testbed import async_save

    PersistentAsyncCaller.async_loop = staticmethod(async_save.megatron_async_loop())
    process = PersistentAsyncCaller._get_process(rank, "forkserver")
    process.join(timeout=60)
    alive = process.is_alive()
    if alive:
        process.kill()
    return alive, process.exitcode


def test_the_worker_writes_the_values_of_the_step_it_saved(tmp_path):
    staged, unstaged = run_world(save_with_and_without_staging, 1, args=(str(tmp_path),), name="tp1", timeout=120)[0]
    print(f"with the host copy (own storage, saved values, changed values): {staged}; without: {unstaged}")
    assert staged == (False, True, False)
    assert unstaged[0], "without the host copy the write plan holds the trainer's own tensor"


def test_without_the_device_fix_the_worker_dies_as_it_starts():
    alive, exitcode = run_world(worker_exit_without_the_device_fix, 1, name="tp1", timeout=120)[0]
    assert not alive and exitcode == 1, (alive, exitcode)
