"""The rank side of `testbed.launcher.run_world`: what runs inside each rank process (forked by the fork server).

`rank_main` isolates the rank (own process group, dies with its parent, stack dumps on
SIGUSR1), runs the function and sends one message back; results travel as `torch.save`
bytes of detached CPU copies (`to_cpu`; the fork server preloaded torch, so every rank has it).
`gloo_process_group` is how a rank joins the world the parent's store hosts (`process_group(device="cuda")`:
NCCL on the rank's own GPU instead, the preflight's CUDA path).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import io
import itertools
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Iterator

_PR_SET_PDEATHSIG = 1


def loads(body: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(body), map_location="cpu", weights_only=False)


def dumps(value: Any) -> bytes:
    """Encode a rank's result with ``torch.save`` (tensors as detached compact CPU copies)."""
    import torch

    buffer = io.BytesIO()
    torch.save(to_cpu(value), buffer)
    return buffer.getvalue()


def to_cpu(value: Any) -> Any:
    """Detached compact CPU copies of tensors inside dicts / lists / tuples (views would ship their whole storage)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").clone()
    if isinstance(value, dict):
        converted = copy.copy(value)  # keeps dict subclasses (OrderedDict, defaultdict) intact
        converted.update((key, to_cpu(item)) for key, item in value.items())
        return converted
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(to_cpu(item) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(item) for item in value)
    return value


def quiet_logging() -> None:
    """Keep a testbed rank's output to what matters: Megatron's and torch's notices (no CUDA, deprecations)
    below ERROR, and this package's INFO lines (Megatron-LM's `training.py` sets the root logger to INFO)."""
    for name in ("megatron", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("megatron_lora_patch").setLevel(logging.WARNING)


def adopt_fd(inherited: Any) -> int:
    """The rank's copy of a descriptor the launcher passed (`multiprocessing.reduction.DupFd`)."""
    return inherited.detach()


def rank_main(
    payload: bytes, env: dict[str, str], conn: Any, stack_file: str, warnings_action: str, stdout: int, stderr: int
) -> None:
    """Entry point of a rank process: isolate, configure, run ``fn``, send one message back.

    ``env`` is the caller's whole environment plus the rank's variables, and ``stdout`` / ``stderr`` the caller's
    descriptors: a rank forked by the fork server otherwise has the server's."""
    import warnings

    for source, target in ((stdout, 1), (stderr, 2)):
        os.dup2(source, target)
        os.close(source)
    warnings.simplefilter(warnings_action)  # before unpickling fn imports Megatron
    os.setpgid(0, 0)  # own process group, so the parent can kill this rank with all its descendants
    _release_fork_server()
    _die_with_parent(os.getppid())  # the fork server, which exits when the caller dies
    os.environ.clear()
    os.environ.update(env)  # before Megatron is imported (unpickling fn may import it)
    from megatron_lora_patch.runtime import bootstrap

    bootstrap.install()  # what the `.pth` line does at start-up, on this rank's environment
    import torch  # preloaded by the fork server, with one thread: this rank's count is set here

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if warnings_action == "ignore":  # start-up notices also go through `logging` ("GPTModel IS DEPRECATED")
        quiet_logging()  # before Megatron imports torch.utils.cpp_extension ("No CUDA runtime is found")
    stack_handle = open(stack_file, "w", encoding="utf-8")
    import faulthandler

    faulthandler.register(signal.SIGUSR1, file=stack_handle, all_threads=True)
    try:
        fn, args, kwargs = pickle.loads(payload)
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        result = fn(rank, world_size, *args, **kwargs)
        message = ("ok", dumps(result))
    except BaseException:
        message = ("error", traceback.format_exc())
    conn.send(message)
    conn.close()
    # Skip interpreter teardown (seconds once torch and Megatron are loaded): the message is
    # already in the pipe, so only buffered output needs flushing.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _release_fork_server() -> None:
    """Close this rank's copy of the fork server's liveness pipe: the server exits when its last holder (the
    caller, once every rank dropped its copy) is gone, and its exit is what kills the ranks (`_die_with_parent`)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _die_with_parent(parent_pid: int) -> None:
    """Make the kernel SIGKILL this rank when the parent dies; fall back to polling where prctl is missing."""
    libc_name = ctypes.util.find_library("c")
    prctl = getattr(ctypes.CDLL(libc_name, use_errno=True), "prctl", None) if libc_name else None
    if prctl is not None and prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


_group_round = itertools.count()


@contextlib.contextmanager
def gloo_process_group(timeout_s: float | None = None) -> Iterator[None]:
    """Initialize the default torch.distributed process group with gloo from the rank's env; destroy it on exit.

    Reads ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` (set by
    :func:`run_world` and by ``torchrun``). Each use in a process joins under a fresh
    key prefix, so a rank may open and close several worlds in sequence (all ranks in
    the same order). ``timeout_s`` bounds each collective (torch's default if ``None``).
    """
    with process_group("cpu", timeout_s):
        yield


@contextlib.contextmanager
def process_group(device: str, timeout_s: float | None = None) -> Iterator[None]:
    """`gloo_process_group` on ``device`` "cpu"; on "cuda" NCCL with this rank on GPU ``RANK % device_count``
    (one GPU per rank: NCCL refuses two ranks on one device)."""
    import torch
    import torch.distributed as dist

    name = "gloo_process_group()" if device == "cpu" else "process_group(cuda)"
    if dist.is_initialized():
        raise RuntimeError(f"{name}: torch.distributed is already initialized in this process")
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if key not in os.environ]
    if missing:
        raise RuntimeError(f"{name}: environment lacks {missing}; run under run_world() or torchrun")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=rank == 0 and not agent_store,
        **({"timeout": timeout} if timeout is not None else {}),
    )
    store = dist.PrefixStore(f"gloo_process_group/{next(_group_round)}", store)
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, **({"timeout": timeout} if timeout else {})
    )
    # A rank may return from init before its peers finished connecting to it; leaving at once (a body that only
    # raises) would close their half-made connections ("Connection closed by peer"): every rank connects first.
    dist.barrier()
    try:
        yield
    finally:
        dist.destroy_process_group()
