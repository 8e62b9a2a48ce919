"""`finalize_grads`: after Megatron's `finalize_model_grads`, SUM replicated LoRA factor grads over their domain.

What it changes (docs/architecture.md sections 3-4):
- `megatron.core.distributed.finalize_model_grads` (the function and the package re-export
  Megatron-LM binds into `config.finalize_model_grads_func`): Megatron's finalize with its
  arguments unchanged, then `lora.training.grad_sync.sum_replicated_adapter_grads(model)` (the
  1/num_tokens scaling is linear and equal on every rank of a domain, so summing after it is exact).
- The schedules' `forward_backward_*`: mark a training step that finalize must cover (a process-wide
  step tracker); a `config.finalize_model_grads_func` still holding the unpatched function is
  swapped for the patched one for the duration of each schedule call.
- `MixedPrecisionOptimizer.prepare_grads` / `FP32Optimizer.prepare_grads`: refuse (strict)
  or warn once about grads no finalize covered after the last backward (SkyRL #223).
- `tensor_parallel.param_is_not_tensor_parallel_duplicate` (grad norm, zero count, and its
  copy bound in `clip_grads`): a replicated factor counts on rank 0 of ITS domain group.
- `_BaseDataParallel.__init__` (every data-parallel wrapper calls it) and the `__init__` of each fully sharded
  wrapper `megatron.core.distributed` exports: an FSDP around a model with adapters stops with one line before it
  shards anything, since the changes above are proven through Megatron's `DistributedDataParallel` only
  (`lora.layers.unsupported.refuse_sharded_data_parallel`).

Each `patch_*` function is the hook for one Megatron module; torch / Megatron are imported
inside them, so importing this module stays cheap.
"""

from __future__ import annotations

import logging
import sys
import types

from megatron_lora_patch.lora.adapters.metadata import adapter_info
from megatron_lora_patch.patches import tested_range
from megatron_lora_patch.runtime import registry
from megatron_lora_patch.runtime.patching import Patcher, PatchSpec

log = logging.getLogger(__name__)

FINALIZE_MODULE = "megatron.core.distributed.finalize_model_grads"
SCHEDULE_FUNCTIONS = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
)
OPTIMIZER_CLASSES = ("MixedPrecisionOptimizer", "FP32Optimizer")
DUPLICATE_PREDICATE = "param_is_not_tensor_parallel_duplicate"

MISSING_FINALIZE = (
    "gradients reached the optimizer without finalize_model_grads after the last training "
    "forward_backward: config.finalize_model_grads_func is None (the SkyRL #223 bug) or does not call "
    "megatron.core.distributed.finalize_model_grads, so the DP grad sync, the 1/num_tokens scaling and the "
    "SUM of replicated LoRA factors over tensor parallel never ran. Fix: set "
    "config.finalize_model_grads_func = megatron.core.distributed.finalize_model_grads before training, "
    "or call that function yourself after the step's last forward_backward"
)


class _StepTracker:
    """Process-wide: has a training schedule run backward that no finalize covered yet?"""

    def __init__(self) -> None:
        self.unfinalized = False

    def reset(self) -> None:
        self.unfinalized = False


TRACKER = _StepTracker()


def _model_chunks(model) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


# -- finalize ------------------------------------------------------------------------------


def _finalize_then_sum_replicated(wrapped, instance, args, kwargs):
    """Megatron's finalize with the caller's arguments untouched, then the replicated SUM."""
    from megatron_lora_patch.lora.training.grad_sync import sum_replicated_adapter_grads

    result = wrapped(*args, **kwargs)
    model = args[0] if args else kwargs["model"]
    sum_replicated_adapter_grads(_model_chunks(model))
    TRACKER.unfinalized = False
    return result


def _patch_finalize(patcher: Patcher, package: types.ModuleType) -> None:
    """Wrap the function in its module, and the package re-export Megatron-LM binds into
    `config.finalize_model_grads_func` with it.

    Hooked on the package: its `__init__` has imported the submodule by then (the package
    attribute `finalize_model_grads` shadows the submodule, hence `sys.modules`).
    """
    patcher.wrap(sys.modules[FINALIZE_MODULE], "finalize_model_grads", _finalize_then_sum_replicated,
                 reexported_by=(package.__name__,))


# -- schedules -----------------------------------------------------------------------------


def _unpatched_finalize():
    module = sys.modules.get(FINALIZE_MODULE)
    return getattr(getattr(module, "finalize_model_grads", None), "__wrapped__", None)


def _needs_finalize(chunks: list) -> bool:
    """Megatron DDP always needs finish_grad_sync; adapters need it once a domain spans ranks."""
    from megatron_lora_patch.lora.training.grad_sync import replicated_adapter_params

    if any(hasattr(chunk, "finish_grad_sync") for chunk in chunks):
        return True
    return next(replicated_adapter_params(chunks), None) is not None


def _track_training_step(wrapped, instance, args, kwargs):
    """Mark the step unfinalized before the schedule (its own finalize clears the mark)."""
    if kwargs.get("forward_only", False):
        return wrapped(*args, **kwargs)
    from megatron.core.utils import get_model_config

    chunks = _model_chunks(kwargs["model"])
    config = get_model_config(chunks[0])
    configured = config.finalize_model_grads_func
    unpatched = _unpatched_finalize()
    swap = unpatched is not None and configured is unpatched
    if swap:
        registry.warn_once(
            "unpatched-func",
            "config.finalize_model_grads_func holds Megatron's finalize_model_grads as bound before the "
            "finalize_grads patch was applied; using the patched function for each training step",
        )
        config.finalize_model_grads_func = sys.modules[FINALIZE_MODULE].finalize_model_grads
    if _needs_finalize(chunks):
        TRACKER.unfinalized = True
    try:
        return wrapped(*args, **kwargs)
    finally:
        if swap:  # the user's config object is left exactly as it was given
            config.finalize_model_grads_func = configured


def patch_schedules(patcher: Patcher, schedules: types.ModuleType) -> None:
    """Every `forward_backward_*` marks a training step that finalize must cover."""
    # get_forward_backward_func looks these names up at call time in every supported version.
    for name in SCHEDULE_FUNCTIONS:
        patcher.wrap(schedules, name, _track_training_step)


# -- optimizer -----------------------------------------------------------------------------


def _refuse_unfinalized_grads(wrapped, instance, args, kwargs):
    if TRACKER.unfinalized:
        TRACKER.unfinalized = False  # reported once per step
        registry.report_problem("missing-finalize", MISSING_FINALIZE)
    return wrapped(*args, **kwargs)


def patch_optimizer(patcher: Patcher, optimizer: types.ModuleType) -> None:
    """`prepare_grads` refuses grads no finalize covered (strict) or warns once."""
    # ChainedOptimizer and DistributedOptimizer reach these through delegation / the MRO.
    for class_name in OPTIMIZER_CLASSES:
        patcher.wrap(getattr(optimizer, class_name), "prepare_grads", _refuse_unfinalized_grads)


# -- grad norm -----------------------------------------------------------------------------


def _count_replicated_once_per_domain(wrapped, instance, args, kwargs):
    """A replicated factor holds the same grad on every rank of its domain after the SUM."""
    param = args[0] if args else kwargs["param"]
    info = adapter_info(param)
    if info is None or not info.replicated:
        return wrapped(*args, **kwargs)
    if info.group is None:
        return True
    import torch.distributed

    return torch.distributed.get_rank(info.group) == 0


def patch_duplicate_predicate(patcher: Patcher, tensor_parallel: types.ModuleType) -> None:
    """The grad norm and zero count see a replicated factor once per domain."""
    patcher.wrap(tensor_parallel, DUPLICATE_PREDICATE, _count_replicated_once_per_domain)


def rebind_clip_grads_predicate(patcher: Patcher, clip_grads: types.ModuleType) -> None:
    """clip_grads binds the predicate at import; rebind it if that happened before the patch."""
    patched = getattr(sys.modules["megatron.core.tensor_parallel"], DUPLICATE_PREDICATE)
    bound = getattr(clip_grads, DUPLICATE_PREDICATE)
    if bound is getattr(patched, "__wrapped__", None):
        patcher.replace(clip_grads, DUPLICATE_PREDICATE, patched)


# -- data-parallel wrappers ------------------------------------------------------------------


def _refuse_sharded_wrappers(wrapped, instance, args, kwargs):
    import inspect

    from megatron_lora_patch.lora.layers.unsupported import refuse_sharded_data_parallel

    refuse_sharded_data_parallel(instance, inspect.signature(wrapped).bind(*args, **kwargs).arguments["module"])
    return wrapped(*args, **kwargs)


def patch_data_parallel_base(patcher: Patcher, base: types.ModuleType) -> None:
    """Every data-parallel wrapper but DDP refuses a model with adapters: its `__init__` calls this one's."""
    patcher.wrap(base._BaseDataParallel, "__init__", _refuse_sharded_wrappers)


def _wrap_sharded_wrappers(patcher: Patcher, package: types.ModuleType) -> None:
    """The fully sharded wrappers the package exports refuse before their own set-up (Megatron FSDP builds its
    device mesh before it calls the base class's `__init__`)."""
    base = sys.modules["megatron.core.distributed.data_parallel_base"]._BaseDataParallel
    for wrapper in vars(package).values():
        if isinstance(wrapper, type) and issubclass(wrapper, base) and wrapper is not base and not issubclass(
            wrapper, package.DistributedDataParallel
        ):
            patcher.wrap(wrapper, "__init__", _refuse_sharded_wrappers)


def patch_distributed(patcher: Patcher, package: types.ModuleType) -> None:
    """Finalize SUMs replicated factors; the fully sharded wrappers refuse adapters; revert forgets any unfinalized
    step."""
    _patch_finalize(patcher, package)
    _wrap_sharded_wrappers(patcher, package)
    patcher.on_revert(TRACKER.reset)


SPEC = PatchSpec(
    name="finalize_grads",
    summary="after finalize_model_grads, SUM replicated LoRA factor grads over their TP / expert-TP domain; "
    "flag steps that skip finalize; count replicated factors once in the grad norm",
    hooks={
        "megatron.core.distributed": patch_distributed,
        "megatron.core.distributed.data_parallel_base": patch_data_parallel_base,
        "megatron.core.pipeline_parallel.schedules": patch_schedules,
        "megatron.core.optimizer.optimizer": patch_optimizer,
        "megatron.core.tensor_parallel": patch_duplicate_predicate,
        "megatron.core.optimizer.clip_grads": rebind_clip_grads_predicate,
    },
    versions=tested_range(),
    default=True,
)
