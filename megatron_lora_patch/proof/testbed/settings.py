"""What one testbed run does: the settings every compared topology shares, and what it records.

Kept apart from `driver` (the step loop) and `model_setup` (Megatron-LM's model and optimizer set-up) so that both
read the same `TrainSettings` without importing each other (tests/test_layers.py: no import cycle).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Union

import torch

from megatron_lora_patch.proof.testbed.pretrain import PER_TOKEN
from megatron_lora_patch.proof.testbed.recording import ModulePredicate, ParamPredicate

#: Sentinel for `finalize_model_grads_func`: resolve Megatron's function when the run starts, so a patch
#: that wrapped `megatron.core.distributed.finalize_model_grads` is picked up, as Megatron-LM's would be.
MEGATRON_FINALIZE = "megatron"


def trainable(name: str, param: torch.nn.Parameter) -> bool:
    """Default capture predicate: every parameter the optimizer updates."""
    return param.requires_grad


@dataclasses.dataclass(frozen=True)
class Capture:
    """What `train_steps` records (module-level callables so it pickles to spawned ranks).

    params: which parameters' grads and values to record (None: none).
    params_every_step: record values after every step, not only after the last.
    forward: which modules' forward outputs to record, per microbatch (None: none).
    on_step_end: `fn(step, record, model_chunks)` called after each optimizer step; it
        may add picklable entries to `record["extra"]` (for later issues' probes).
    """

    params: Optional[ParamPredicate] = trainable
    params_every_step: bool = False
    forward: Optional[ModulePredicate] = None
    on_step_end: Optional[Callable[[int, dict, list], None]] = None


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """The knobs of one run, identical on every topology compared with each other.

    `global_batch_size` is fixed across topologies (Megatron's semantics); each DP rank
    runs `global_batch_size / (micro_batch_size * dp)` microbatches.
    `calculate_per_token_loss=None` leaves the model config as built (a patch may set it).
    `finalize_model_grads_func=None` leaves `config.finalize_model_grads_func` unset.
    `on_model_built(chunks)` runs on the bare model chunks before DDP wrapping.
    `adam_eps` is 1e-4, not Megatron's 1e-8: with eps far below the fp32 noise of a
    grad, Adam's update ~ lr * g / |g| turns reduction-order noise in near-zero grads
    into O(lr) weight differences (6.5e-5 relative after step 2 on TP2+SP); at 1e-4 a
    topology stays within 1.5e-6 of world 1 while Adam still normalizes typical grads.
    """

    steps: int = 2
    seed: int = 1234
    global_batch_size: int = 8
    micro_batch_size: int = 1
    lr: float = 1e-2
    clip_grad: float = 1.0
    weight_decay: float = 0.01
    adam_eps: float = 1e-4
    calculate_per_token_loss: Optional[bool] = True
    loss_variant: str = PER_TOKEN
    finalize_model_grads_func: Union[str, Callable, None] = MEGATRON_FINALIZE
    on_model_built: Optional[Callable[[list], None]] = None
    capture: Capture = Capture()
    data_path: Optional[str] = None  # a Megatron indexed dataset prefix read in order instead of random tokens
    use_distributed_optimizer: bool = False  # grads are gathered back for capture (testbed.distributed_optimizer)
    # Megatron-LM's `--overlap-grad-reduce` / `--overlap-param-gather` (the latter needs the distributed
    # optimizer): DDP reduces each bucket asynchronously once its last grad arrives, and gathers params in
    # forward pre-hooks, with the config callbacks `setup_model_and_optimizer` sets; `ddp_bucket_size` (params
    # per bucket; None: DDP's default) small makes several buckets, so reductions start inside backward.
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: Optional[int] = None
    # TransformerConfig fields for the built model, e.g. {"gradient_accumulation_fusion": True}
    model_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # "cuda": every rank on its own GPU with NCCL (the preflight's CUDA path; the model is built on CPU and moved,
    # like Megatron-LM's `get_model` under --use-cpu-initialization), "cpu": gloo
    device: str = "cpu"
