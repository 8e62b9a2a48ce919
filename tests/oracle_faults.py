"""Fault-injecting mutation installs for the oracle's own tests (module level: pickled to ranks)."""

import time


def crash_on_rank_1(patcher) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("injected failure on rank 1")


def hang_on_rank_1(patcher) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(3600)
