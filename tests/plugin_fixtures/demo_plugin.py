"""Test plugin `demo`: one patch per runtime behaviour under test, all on `demo_target`."""

from megatron_lora_patch.runtime.hookspecs import impl
from megatron_lora_patch.runtime.patching import PatchSpec
from megatron_lora_patch.runtime.registry import SkipPatch

CONFIGURED = []


def _shout(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs).upper()


def wrap_greet(patcher, module):
    patcher.wrap(module, "greet", _shout)


def wrap_farewell(patcher, module):
    patcher.wrap(module, "farewell", _shout)


def wrap_then_fail(patcher, module):
    patcher.wrap(module.Greeter, "hello", _shout)
    raise RuntimeError("boom half way")


def wrap_then_skip(patcher, module):
    patcher.wrap(module.Greeter, "hello", _shout)
    raise SkipPatch("already upstream")


@impl
def megatron_lora_patch_patches():
    return [
        PatchSpec("demo_shout", "upper-cases greet()", {"demo_target": wrap_greet}, ">=0.13", True),
        PatchSpec("demo_optional", "upper-cases farewell()", {"demo_target": wrap_farewell}, ">=0.13", False),
        PatchSpec("demo_future", "needs a future Megatron", {"demo_target": wrap_farewell}, ">=99", False),
        PatchSpec("demo_broken", "fails half way", {"demo_target": wrap_then_fail}, ">=0.13", False),
        PatchSpec("demo_upstream", "skips itself", {"demo_target": wrap_then_skip}, ">=0.13", False),
    ]


@impl
def megatron_lora_patch_configure(settings):
    CONFIGURED.append(settings)
