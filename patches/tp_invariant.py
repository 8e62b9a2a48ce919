"""`tp_invariant`: the former name of the `layout_invariant` patch (patches/layout_invariant.py).

The name keeps working (`enable={"tp_invariant": True}`, `MEGATRON_LORA_PATCH_TP_INVARIANT=1`,
`MEGATRON_LORA_DISABLED_PATCHES=tp_invariant`) with a one-line deprecation warning
(`flags.RENAMED_PATCHES`); this module re-exports the one declaration.
"""

from megatron_lora_patch.patches.layout_invariant import SPEC

__all__ = ["SPEC"]
