"""Output directories that are never overwritten by accident and never left half-written.

`check_target` refuses a target that is a file, that is not empty (unless the caller
passed overwrite / `--force`), or that cannot be created; it runs before any work.
The output is then written into a staging directory beside the target (same parent,
so the final rename stays on one filesystem) and `publish` moves it into place: an
interrupted write leaves the old target as it was. `staged` does both for one process;
`checkpoint.save_adapters` uses the pieces across ranks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

from megatron_lora_patch.runtime.errors import UsageError


class OutputDirectoryError(UsageError):
    """An output directory cannot be used as asked (the message names it and the fix)."""


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def followed(path: str) -> str:
    """`path`, or the target of the symbolic link it is (existing or not): the output replaces the directory the
    link names and the link stays (renaming onto the link itself fails only after the whole output is written)."""
    return os.path.realpath(path) if os.path.islink(path) else path


def check_target(path: str, label: str, overwrite_hint: str, overwrite: bool) -> None:
    """Refuse `path` (named `label` in messages) if it is a file, non-empty without `overwrite`, or not creatable;
    a symbolic link is checked as the directory it names."""
    if not path:
        raise OutputDirectoryError(f"{label} is empty; name an output directory")
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputDirectoryError(f"{label} {path} is a file, not a directory; name a directory")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise OutputDirectoryError(
            f"{label} {path} is not empty; {overwrite_hint} to replace it, or name a new directory"
        )
    parent = os.path.dirname(os.path.abspath(followed(path)))
    existing = _nearest_existing(parent)
    if not os.path.isdir(existing):
        raise OutputDirectoryError(f"{label} {path} cannot be created: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputDirectoryError(f"{label} {path} cannot be created: {existing} is not writable")


def umask() -> int:
    """The process umask (reading it means setting it; set straight back: not for threads writing files)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_staging(path: str, label: str) -> str:
    """A new empty directory beside `path` (its parent created if needed) to write the output into.

    `mkdtemp` makes it 0700 whatever the umask; it becomes the published output, so it gets the
    mode `os.makedirs` would give it (0777 less the umask), readable like any `save_pretrained` output.
    """
    parent, name = os.path.split(os.path.abspath(followed(path)))
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(dir=parent, prefix=f".{name}.partial-")
        os.chmod(staging, 0o777 & ~umask())
        return staging
    except OSError as error:
        raise OutputDirectoryError(f"{label} {path} cannot be created in {parent}: {error.strerror}") from None


def publish(staging: str, path: str, label: str) -> None:
    """Move the finished `staging` directory to `path` (a link: to the directory it names); an existing `path` is
    removed only once replaced, and put back if the new output cannot take its place."""
    target = followed(path)
    parent, name = os.path.split(os.path.abspath(target))
    replaced = None
    try:
        if os.path.isdir(target):
            replaced = tempfile.mkdtemp(dir=parent, prefix=f".{name}.replaced-")
            os.rename(target, replaced)  # onto the empty directory just made (POSIX rename replaces it)
        os.rename(staging, target)
    except OSError as error:
        if replaced is not None and os.path.exists(target):
            os.rmdir(replaced)  # the old output never moved: only the empty placeholder goes
        elif replaced is not None:
            os.rename(replaced, target)  # the old output back where it was
        raise OutputDirectoryError(
            f"{label} {path} could not be put in place ({error.strerror}); the output is in {staging}"
        ) from None
    if replaced is not None:
        shutil.rmtree(replaced)


def discard(staging: str) -> None:
    """Remove a staging directory whose output was not finished."""
    shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def staged(path: str, label: str) -> Iterator[str]:
    """Yield a staging directory for `path`; on success it becomes `path`, on any error it is removed."""
    staging = make_staging(path, label)
    try:
        yield staging
    except BaseException:
        discard(staging)
        raise
    publish(staging, path, label)
