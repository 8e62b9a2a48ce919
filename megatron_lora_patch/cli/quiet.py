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


@contextlib.contextmanager
def quiet(verbose: bool, imports_torch: bool = True) -> Iterator[None]:
    """Inside: warnings ignored and the NOISY_LOGGERS at ERROR, unless `verbose`; restored on exit.

    Where the command imports torch anyway (`imports_torch`), torch is imported first: its import resets
    the "torch" logger's level, and the CPU notice of `torch.utils.cpp_extension` ("No CUDA runtime is
    found") comes later, when Megatron imports it."""
    if verbose:
        yield
        return
    if imports_torch:
        import torch  # noqa: F401  (see the docstring: the level must be set after this import)
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def add_verbose(parser) -> None:
    """The `-v / --verbose` option of a quiet subcommand."""
    parser.add_argument("-v", "--verbose", action="store_true", help="show Megatron / torch warnings")
