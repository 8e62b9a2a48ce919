"""Megatron's CUDA RNG tracker, backed by the CPU generator.

On a CPU-only build `torch.cuda.manual_seed` is a silent no-op and reading or setting
the CUDA RNG state raises, so the tracker (`tensor_parallel/random.py`) can neither add
nor fork a state. On the host the "CUDA" generator is the CPU default generator: the
tracker's named states become CPU generator states, forking swaps them in and out of
the CPU generator, and seeding seeds it. Random streams per name and per rank stay
distinct exactly as Megatron defines them (same seeds, same offsets). Outside a fork the
default CUDA state (`_get_cuda_rng_state`, which activation recompute saves and restores) is
the host's own CUDA default generator, `device_rng.GENERATOR`.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_lora_patch.cpu_testbed import device_rng


def get_host_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Replacement of `random._get_cuda_rng_state`: the host's CUDA default generator state
    (`device_rng.GENERATOR`), which activation recompute saves beside the CPU state and the tracker's."""
    return device_rng.get_rng_state()


def set_host_rng_state(new_state: torch.Tensor, device=None, graph_safe: bool = False) -> None:
    """Replacement of `random._set_cuda_rng_state`: set the host's CUDA default generator state."""
    device_rng.set_rng_state(new_state)


def add_host_state(wrapped, tracker, args, kwargs):
    """`CudaRNGStatesTracker.add(name, seed)` storing a CPU generator state seeded with `seed`."""

    def add(name, seed):
        if seed in tracker.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in tracker.states_:
            raise Exception(f"cuda rng state {name} already exists")
        tracker._is_initialized = True
        tracker.seeds_.add(seed)
        outer_state = torch.get_rng_state()
        torch.manual_seed(seed)
        tracker.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer_state)

    return add(*args, **kwargs)


def make_fork_host_state(default_name: str):
    """`CudaRNGStatesTracker.fork(name)` swapping CPU generator states.

    Same bookkeeping as Megatron's fork (nested forks, `_current_state_name`), without
    its "CPU RNG state changed within GPU RNG context" warning, which would fire on every
    fork here because the tracked generator *is* the CPU generator.
    """

    @contextlib.contextmanager
    def fork(tracker, name=default_name):
        if name not in tracker.states_:
            raise Exception(f"cuda rng state {name} is not added")
        # Megatron 0.14+ tracks the active state name (nested forks); 0.13 has no such field.
        tracks_names = hasattr(tracker, "_current_state_name")
        outer_state = torch.get_rng_state()
        outer_name = tracker._current_state_name if tracks_names else "default-rng"
        if outer_name != "default-rng":
            tracker.states_[outer_name] = outer_state
        torch.set_rng_state(tracker.states_[name])
        if tracks_names:
            tracker._current_state_name = name
        try:
            with device_rng.tracker_fork():
                yield
        finally:
            if tracks_names and tracker._current_state_name != name:
                raise Exception(
                    f"current state name {tracker._current_state_name} is not the same as "
                    f"the desired state name {name}."
                )
            tracker.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer_state = tracker.states_[outer_name]
            torch.set_rng_state(outer_state)
            if tracks_names:
                tracker._current_state_name = outer_name

    def fork_host_state(wrapped, tracker, args, kwargs):
        return fork(tracker, *args, **kwargs)

    return fork_host_state


def seed_host_generator(wrapped, instance, args, kwargs):
    """`model_parallel_cuda_manual_seed(seed, ...)` also seeding the CPU generator.

    Megatron seeds the default CUDA generator with `seed` (the data-parallel stream);
    on the host that generator is the CPU one.
    """
    seed = kwargs["seed"] if "seed" in kwargs else args[0]
    torch.manual_seed(seed)
    return wrapped(*args, **kwargs)


def install(patcher, random_module) -> None:
    """Apply the host RNG fixes to `megatron.core.tensor_parallel.random`."""
    tracker_class = random_module.CudaRNGStatesTracker
    patcher.replace(random_module, "_get_cuda_rng_state", get_host_rng_state)
    patcher.replace(random_module, "_set_cuda_rng_state", set_host_rng_state)
    patcher.wrap(tracker_class, "add", add_host_state)
    patcher.wrap(
        tracker_class,
        "fork",
        make_fork_host_state(random_module._MODEL_PARALLEL_RNG_TRACKER_NAME),
    )
    patcher.wrap(
        random_module,
        "model_parallel_cuda_manual_seed",
        seed_host_generator,
        reexported_by=("megatron.core.tensor_parallel",),
    )
