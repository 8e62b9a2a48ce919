"""The reported loss of a step, reduced over every global microbatch in a fixed order
(docs/architecture.md section 7).

Megatron-LM's `train_step` logs `sum(loss sums) / sum(token counts)`, each summed in fp32 over
this rank's microbatches and then all-reduced over data parallel: the summation order changes
with the DP degree, so the logged loss differs in its last bits although every microbatch loss
is identical. `reduced_loss` all-gathers the per-microbatch `[loss sum, token count]` pairs of
the DP group and adds them with `math.fsum` (exactly rounded, so independent of their order):
the same float on every layout. Call it on the last pipeline stage, where the reports are.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.distributed

from megatron_lora_patch.layout_invariant import LayoutInvariantUnsupported

REPORT_KEY = "lm loss"


def reduced_loss(reports: List[dict], key: str = REPORT_KEY) -> Optional[float]:
    """Loss sum over token count of the global batch from the schedule's per-microbatch `reports`
    (`{key: [loss sum, token count]}`, the per-token contract), identical on every layout."""
    from megatron.core import parallel_state

    if not reports:
        return None
    # on the reports' own device: NCCL gathers CUDA tensors only (a CPU tensor there: "No backend type associated
    # with device type cpu", seen on an H200); gloo takes the CPU ones
    pairs = torch.stack([report[key].detach().reshape(-1).to(torch.float64) for report in reports])
    if pairs.shape[1] != 2:
        raise LayoutInvariantUnsupported(
            f"layout_invariant: the loss report {key!r} holds {pairs.shape[1]} values, not [loss sum, tokens]; "
            "return the per-token contract from the loss function"
        )
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    pieces = [torch.empty_like(pairs) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(pieces, pairs, group=group)
    every = torch.cat(pieces).cpu()
    return math.fsum(every[:, 0].tolist()) / math.fsum(every[:, 1].tolist())
