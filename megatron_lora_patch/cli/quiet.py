"""Quiet imports for the CLI's reports: `status` and `export` print a table or one line, and the
notices Megatron-Core and torch emit while they are imported on a CPU machine (no Transformer
Engine / Apex / CUDA runtime, via `warnings` and their `logging` loggers) would bury it. `-v` shows
them. Errors still surface: an exception is never silenced, and loggers keep ERROR."""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator

#: Loggers whose import-time WARNINGs are noise for a CLI report (children inherit the level).
NOISY_LOGGERS = ("torch", "megatron")
#: This package's logger stays at WARNING: its INFO lines ("applied ...") would otherwise reach stdout once
#: Megatron-LM's `training.py` is imported (it sets the root logger to INFO with a stdout handler), and
#: break `status --json`.
OWN_LOGGER = "megatron_lora_patch"


@contextlib.contextmanager
def quiet(verbose: bool, imports_torch: bool = True) -> Iterator[None]:
    """Inside: OWN_LOGGER at WARNING (the report says what was applied), and unless `verbose` warnings
    ignored and the NOISY_LOGGERS at ERROR; restored on exit.

    Where the command imports torch anyway (`imports_torch`), torch is imported first: its import resets
    the "torch" logger's level, and the CPU notice of `torch.utils.cpp_extension` ("No CUDA runtime is
    found") comes later, when Megatron imports it."""
    if imports_torch and not verbose:
        import torch  # noqa: F401  (see the docstring: the level must be set after this import)
    quieted = {OWN_LOGGER: logging.WARNING} | ({} if verbose else {name: logging.ERROR for name in NOISY_LOGGERS})
    loggers = {logging.getLogger(name): level for name, level in quieted.items()}
    saved = {logger: logger.level for logger in loggers}
    with warnings.catch_warnings():
        if not verbose:
            warnings.simplefilter("ignore")
        for logger, level in loggers.items():
            logger.setLevel(level)
        try:
            yield
        finally:
            for logger, level in saved.items():
                logger.setLevel(level)


def add_verbose(parser) -> None:
    """The `-v / --verbose` option of a quiet subcommand."""
    parser.add_argument("-v", "--verbose", action="store_true", help="show Megatron / torch warnings")
