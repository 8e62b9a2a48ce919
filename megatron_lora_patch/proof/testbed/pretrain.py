"""`forward_step` and loss functions with the contract of Megatron-LM's `pretrain_gpt.py`.

Current contract (what the schedule in `pipeline_parallel/schedules.py` consumes):
`loss_func(loss_mask, output_tensor)` returns `(sum of masked per-token losses,
num_tokens as an int tensor, {'lm loss': [loss_sum, num_tokens]})`, all per-rank
values; with `config.calculate_per_token_loss` on, the schedule sums `num_tokens`
over microbatches and `finalize_model_grads` all-reduces it over DP x CP and scales
the grads by its inverse.

The legacy contract returns `(microbatch mean, {'lm loss': [mean]})`; the schedule then
divides by the number of microbatches and DDP averages over DP x CP (a mean of means).
It is offered because the loss-normalization patch must detect and reject it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Iterator, List, Optional

import torch

from megatron_lora_patch.proof.testbed.data import Batch, cp_rank_slice
from megatron_lora_patch.proof.testbed.packing import packed_seq_params

PER_TOKEN = "per_token"
LEGACY_MEAN = "legacy_mean"
LOSS_VARIANTS = (PER_TOKEN, LEGACY_MEAN)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """Per-token contract: `(masked loss sum, num_tokens, report)` for this rank's microbatch."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    report = {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}
    return loss_sum, num_tokens, report


def legacy_mean_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """Legacy contract: `(microbatch mean loss, {'lm loss': [DP-averaged mean]})`.

    Under CP the mean is over the whole sequence (token count all-reduced over CP,
    as older `pretrain_gpt.py` did); the returned value is this rank's share of it, so
    its gradient is the one Megatron back-propagated. The report is the DP mean of
    microbatch means, like the old `average_losses_across_data_parallel_group`.
    """
    from megatron.core import parallel_state

    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    sequence_tokens = mask.sum().detach()
    torch.distributed.all_reduce(sequence_tokens, group=parallel_state.get_context_parallel_group())
    local_share = torch.sum(losses * mask) / torch.clamp(sequence_tokens, min=1)
    reported = local_share.detach().clone()
    torch.distributed.all_reduce(reported, group=parallel_state.get_context_parallel_group())
    torch.distributed.all_reduce(reported, group=parallel_state.get_data_parallel_group())
    reported /= parallel_state.get_data_parallel_world_size()
    return local_share, {"lm loss": reported.view(1)}


_LOSS_FUNCTIONS = {PER_TOKEN: loss_func, LEGACY_MEAN: legacy_mean_loss_func}


def loss_function_for(variant: str) -> Callable:
    """The loss function of a named variant; errors list the valid names."""
    try:
        return _LOSS_FUNCTIONS[variant]
    except KeyError:
        raise ValueError(f"unknown loss variant {variant!r}; use one of {LOSS_VARIANTS}") from None


@functools.lru_cache(maxsize=None)
def _forward_accepts_loss_mask(model_class: type) -> bool:
    return "loss_mask" in inspect.signature(model_class.forward).parameters


def _innermost(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def forward_step(data_iterator: Iterator[Batch], model: torch.nn.Module, loss_function: Callable = loss_func):
    """One microbatch: this CP rank's slice of the next batch through the model.

    Every pipeline stage draws from the iterator (stages that do not need the data
    ignore it), so all stages stay on the same microbatch. Attention mask is None:
    the causal mask is implied, as in `pretrain_gpt.py` without a dataloader mask. A packed batch
    (`cu_seqlens`) goes in as Megatron's `PackedSeqParams` (THD), `pretrain_gpt.py`'s way.
    """
    batch = cp_rank_slice(next(data_iterator))
    device = next(model.parameters()).device  # the batches are made on CPU; a CUDA rank's model is on its GPU
    batch = {key: value.to(device) for key, value in batch.items()}
    extra = {}
    if "cu_seqlens" in batch:
        extra["packed_seq_params"] = packed_seq_params(batch["cu_seqlens"])
    if _forward_accepts_loss_mask(type(_innermost(model))):
        extra["loss_mask"] = batch["loss_mask"]
    output_tensor = model(
        batch["tokens"], batch["position_ids"], None, labels=batch["labels"], **extra
    )
    return output_tensor, functools.partial(loss_function, batch["loss_mask"])


def forward_step_for(variant: str) -> Callable:
    """`forward_step(data_iterator, model)` bound to the loss variant's function."""
    return functools.partial(forward_step, loss_function=loss_function_for(variant))


def reduced_lm_loss(reports: List[dict]) -> Optional[float]:
    """Megatron-LM `train_step`'s logged loss: token mean over DP x CP, or mean of means (legacy);
    under the layout-invariant mode its exact reduction (`layout_invariant.losses`)."""
    from megatron.core import parallel_state

    from megatron_lora_patch.layout_invariant import losses
    from megatron_lora_patch.patches import layout_invariant as hooks

    if not reports:
        return None
    if hooks.is_active():  # the layout-invariant mode's own, layout-independent reduction
        return losses.reduced_loss(reports)
    values = [report["lm loss"].view(-1) for report in reports]
    if values[0].numel() == 2:
        total = torch.vstack(values).sum(dim=0)
        torch.distributed.all_reduce(
            total, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        return (total[0] / total[1]).item()
    return torch.cat(values).mean().item()
