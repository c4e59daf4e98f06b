"""Where a model file may be written: a new file, or over a GGUF file when asked to.

``foundry export``, ``foundry model init`` and ``foundry train --out`` write a GGUF file
atomically (a temporary file renamed over the target, ``gguf_io.save_gguf``). Before that,
:func:`check_output` refuses a target that would destroy something else: a checkpoint, a text
file, any file that is not a GGUF model (never replaced), a folder, and an existing GGUF
file unless the caller passed ``--force``.
"""

from __future__ import annotations

from pathlib import Path

GGUF_MAGIC = b"GGUF"


class OutputRefused(ValueError):
    """A model file target that must not be written; the message says what to do."""


def check_output(path: Path, *, force: bool, flag: str = "--out") -> None:
    """Raise OutputRefused unless ``path`` may take a new model file (see the module)."""
    resolved = path.resolve()
    if resolved.is_dir():
        raise OutputRefused(f"{flag} {path} is a folder; name a file in it (model.gguf)")
    if not resolved.parent.is_dir():
        raise OutputRefused(f"{flag} {path}: folder {path.parent} does not exist; create it first")
    if not resolved.exists():
        return
    try:
        with resolved.open("rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise OutputRefused(
            f"{flag} {path} exists and cannot be read ({exc}); not overwriting it"
        ) from None
    if head != GGUF_MAGIC:
        raise OutputRefused(
            f"{flag} {path} exists and is not a GGUF file (it starts with {head!r}); not "
            "overwriting it: choose another path (a checkpoint or any other file is never "
            "replaced)"
        )
    if not force:
        raise OutputRefused(
            f"{flag} {path} exists (a GGUF model file); pass --force to replace it, or choose "
            "another path"
        )
