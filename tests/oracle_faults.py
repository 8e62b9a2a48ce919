"""Fault-injecting mutation installs for the oracle's own tests (module level: pickled to ranks)."""

import contextlib
import time


def crash_on_rank_1(patcher) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("injected failure on rank 1")


def hang_on_rank_1(patcher) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(3600)


@contextlib.contextmanager
def crashing_context():
    """A `Job.context` whose run fails before the model is built (the oracle's reference-failure path)."""
    raise RuntimeError("injected failure in the reference")
    yield
