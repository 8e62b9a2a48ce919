"""The model and optimizer set-up of Megatron-LM's `get_model` and `setup_model_and_optimizer`, on the testbed:
attribute defaults, the move to the rank's GPU on a CUDA world, Float16Module for half precision, Megatron DDP and
its DP broadcast; Megatron's optimizer; the config callbacks `train` sets for the overlap options
(`testbed.driver` runs the steps)."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from megatron_lora_patch.proof.testbed.settings import MEGATRON_FINALIZE, TrainSettings


def wrap_like_get_model(chunks: list, settings: TrainSettings) -> list:
    """Megatron-LM `get_model`: attribute defaults, Float16Module, DDP, DP broadcast."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config = chunks[0].config
    for chunk in chunks:
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if settings.device == "cuda":
        chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
    if settings.calculate_per_token_loss is not None:
        # Must happen before DDP is built: DDP picks its pre-reduction scaling from it.
        config.calculate_per_token_loss = settings.calculate_per_token_loss
    if config.fp16 or config.bf16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=settings.overlap_grad_reduce,
        overlap_param_gather=settings.overlap_param_gather,
        bucket_size=settings.ddp_bucket_size,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        # average_in_collective is incompatible with per-token loss (DDP asserts it).
        average_in_collective=False,
    )
    wrapped = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    for chunk in wrapped:
        chunk.broadcast_params()
    return wrapped


def build_optimizer(chunks: list, settings: TrainSettings):
    """Megatron's optimizer (plain or distributed) over the wrapped chunks, as `setup_model_and_optimizer` makes it."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = chunks[0].config
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.lr,
        weight_decay=settings.weight_decay,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad,
        fp16=config.fp16,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=settings.use_distributed_optimizer,
    )
    return get_megatron_optimizer(optimizer_config, chunks)


def resolve_finalize(choice: Union[str, Callable, None]) -> Optional[Callable]:
    """`TrainSettings.finalize_model_grads_func` as the callable the config gets."""
    if choice == MEGATRON_FINALIZE:
        from megatron.core import distributed

        return distributed.finalize_model_grads
    if choice is None or callable(choice):
        return choice
    raise ValueError(
        f"finalize_model_grads_func must be {MEGATRON_FINALIZE!r}, None or a callable; got {choice!r}"
    )


def set_sync_callbacks(config, chunks: list, settings: TrainSettings) -> None:
    """The DDP callbacks Megatron-LM's `train` sets for the overlap options (its defaults `align_grad_reduce`
    on, `align_param_gather` off): the schedule's `no_sync` around all but the last microbatch, and the
    grad-sync start the pipeline schedules call per chunk."""
    if settings.overlap_grad_reduce:
        config.no_sync_func = [chunk.no_sync for chunk in chunks]
        config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks]
        if len(chunks) == 1:
            config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]
