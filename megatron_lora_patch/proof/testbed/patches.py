"""Which patches a test process runs with: exactly the named ones, from both plugins.

The tests and the oracle run Megatron on CPU, so they load the production `lora_correct`
plugin and the `cpu_testbed` plugin (its `cpu_compat` patch) together; every patch not named
is turned off explicitly, so no default sneaks in.
"""

from __future__ import annotations

from typing import Collection, Optional

#: The plugins of a test process: production patches plus the CPU host support.
TESTBED_PLUGINS = ("lora_correct", "cpu_testbed")


def all_patch_names() -> tuple[str, ...]:
    """Every patch of `TESTBED_PLUGINS`, in application order."""
    from megatron_lora_patch.plugins import cpu_testbed as testbed
    from megatron_lora_patch.plugins import lora_correct

    return testbed.PATCH_NAMES + lora_correct.PATCH_NAMES


def apply_only(names: Collection[str], strict: Optional[bool] = None) -> list:
    """Apply the two plugins with exactly the patches in `names` on; returns the status rows."""
    import megatron_lora_patch
    from megatron_lora_patch.runtime.flags import current_patch_name

    names = {current_patch_name(name) for name in names}
    unknown = set(names) - set(all_patch_names())
    if unknown:
        raise ValueError(f"apply_only: unknown patches {sorted(unknown)}; known: {', '.join(all_patch_names())}")
    enable = {name: name in names for name in all_patch_names()}
    return megatron_lora_patch.apply(plugins=TESTBED_PLUGINS, enable=enable, strict=strict)
