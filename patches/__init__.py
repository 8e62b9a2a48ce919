"""The patches: one module per patch, each holding its `PatchSpec` (named `SPEC`: the Megatron-Core modules it
targets and the hook for each), the hooks and wrappers themselves, and a docstring saying what the patch changes
and why (docs/architecture.md section 3).

The Megatron-Core range every patch is tested on is declared here once: `scripts/run-tests.sh` runs each minor
of it (tests/test_plugin_table.py checks that the two agree)."""

#: The oldest and newest Megatron-Core minor the patches are tested on.
OLDEST_TESTED = "0.13"
NEWEST_TESTED = "0.19"


def tested_range(oldest: str = OLDEST_TESTED) -> str:
    """The PEP 440 range from `oldest` (a patch that needs a newer Megatron-Core names it) through the newest
    tested minor, every patch release of it included."""
    major, minor = NEWEST_TESTED.split(".")
    return f">={oldest},<{major}.{int(minor) + 1}"
