"""S8, S9: Megatron-Core's asynchronous checkpoint save (`--async-save`) on the host.

Megatron-LM 0.17+ saves asynchronously only through `PersistentAsyncCaller` (`--async-save` needs
`--use-persistent-ckpt-worker`; `--async-strategy mcore` without nvidia-resiliency-ext): a worker
process, started from a fork server, writes each checkpoint while the trainer steps on. Two of its
steps assume a GPU.

- S8 The worker first selects its GPU with `torch.cuda.set_device(rank % torch.cuda.device_count())`.
  Without CUDA that divides by zero: the worker dies before its first write and the trainer waits on
  its queue for ever (measured: the first save of a 4-step run never returned). The host runs the
  worker's loop as on one device (`training.one_host_device`: `device_count()` 1, `set_device` a
  no-op). The worker is a separate process whose target is pickled by reference, so the class
  attribute becomes `host_async_loop`, a module function the worker imports; it finds Megatron's own
  loop whether or not the worker's interpreter applied this patch too (`megatron_async_loop`).
- S9 On a GPU the tensors to write are copied device-to-host (`FileSystemWriterAsync.preload_tensors`)
  before the trainer is let go, so the worker writes that step's values while the next step updates
  the weights. On the host they are already host tensors: `prepare_write_data` clones only views, and
  `.to("cpu")` returns the trainer's own tensor, which the worker would write while the next step
  changes it. The host takes that copy itself right after `prepare_write_data` (`stage_host_copies`),
  before the save returns: the values a GPU run's worker writes. `tests/test_async_save_host.py`
  checks both against these definitions.
"""

from __future__ import annotations

import types

from megatron_lora_patch.cpu_testbed.training import one_host_device
from megatron_lora_patch.runtime.patching import inspect_static

#: Megatron's `PersistentAsyncCaller.async_loop` as this process found it before `install_worker` replaced it.
_MEGATRON_LOOPS: list = []


def megatron_async_loop():
    """Megatron's worker loop: the one `install_worker` replaced in this process, else the class's own."""
    # In a worker whose interpreter applies this patch, this import is what installs it (and records the loop).
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    if _MEGATRON_LOOPS:
        return _MEGATRON_LOOPS[-1]
    return inspect_static(PersistentAsyncCaller, "async_loop").__func__


def host_async_loop(*args, **kwargs):
    """S8: the worker process's target, Megatron's loop with the host as the one device it selects."""
    loop = megatron_async_loop()
    with one_host_device():
        return loop(*args, **kwargs)


def install_worker(patcher, async_utils: types.ModuleType) -> None:
    caller = async_utils.PersistentAsyncCaller
    _MEGATRON_LOOPS.append(inspect_static(caller, "async_loop").__func__)
    patcher.on_revert(_MEGATRON_LOOPS.clear)
    patcher.replace(caller, "async_loop", staticmethod(host_async_loop))


def stage_host_copies(wrapped, writer, args, kwargs):
    """S9: after Megatron plans the write, every tensor in it is a copy of its own (a GPU's D2H copy)."""
    result = wrapped(*args, **kwargs)
    writer.write_buckets = [
        (path, file_name, (bytes_data, [(item, tensor.detach().clone()) for item, tensor in tensor_data]))
        for path, file_name, (bytes_data, tensor_data) in writer.write_buckets
    ]
    return result


def install_host_staging(patcher, filesystem_async: types.ModuleType) -> None:
    patcher.wrap(filesystem_async.FileSystemWriterAsync, "prepare_write_data", stage_host_copies)
