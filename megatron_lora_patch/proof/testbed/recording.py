"""What a testbed rank records while it trains (docs/architecture.md section 8): the captured parameters
with their shard of the logical tensor, their finalized grads, each matched module's forward output per
microbatch, and each microbatch's raw loss values before the schedule rescales them."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from megatron_lora_patch.proof.testbed.rank import to_cpu

ParamPredicate = Callable[[str, torch.nn.Parameter], bool]
ModulePredicate = Callable[[str, torch.nn.Module], bool]


def captured_params(chunks: list, predicate: Optional[ParamPredicate]) -> Dict[str, tuple]:
    """local name -> (parameter, its `shards.Shard` in the logical tensor) for matched params."""
    from megatron_lora_patch.proof.testbed.shards import named_shards

    if predicate is None:
        return {}
    return {name: (param, shard) for name, param, shard in named_shards(chunks) if predicate(name, param)}


def grad_of(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The finalized grad: `main_grad` under Megatron DDP, `.grad` otherwise."""
    grad = getattr(param, "main_grad", None)
    return grad if grad is not None else param.grad


class ForwardRecorder:
    """Forward hooks that append each matched module's output, per microbatch."""

    def __init__(self, model: torch.nn.Module, predicate: Optional[ModulePredicate]):
        self.outputs: Dict[str, list] = {}
        self._handles = []
        if predicate is None:
            return
        for name, module in model.named_modules():
            if predicate(name, module):
                self._handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def record(module, inputs, output):
            self.outputs.setdefault(name, []).append(to_cpu(output))

        return record

    def take(self) -> Dict[str, list]:
        outputs, self.outputs = self.outputs, {}
        return outputs

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def recording_losses(forward_step: Callable, sink: List[dict]) -> Callable:
    """`forward_step` whose loss function also appends this rank's raw microbatch values to `sink`.

    Read before the schedule divides the loss in place; the report dict may be a DP
    average (legacy) and so is not a per-microbatch value.
    """

    def recorded_forward_step(data_iterator, model):
        output_tensor, loss_function = forward_step(data_iterator, model)

        def recorded_loss_function(output):
            outputs = loss_function(output)
            if len(outputs) == 3:
                sink.append({"loss_sum": outputs[0].item(), "num_tokens": int(outputs[1])})
            else:
                sink.append({"loss_mean": outputs[0].item()})
            return outputs

        return output_tensor, recorded_loss_function

    return recorded_forward_step
