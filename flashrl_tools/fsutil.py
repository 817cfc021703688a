"""Filesystem helpers: hashing and all-or-nothing directory output."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from flashrl_tools.errors import FlashRLError


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_writable(path: Path | None, flag: str = "-o") -> None:
    """Fail before any work when `path` (a file or directory to write) cannot be created: its parent
    cannot be made or written to. Leaves nothing behind."""
    if path is None:
        return
    path = Path(path).expanduser()
    parent = path.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise FlashRLError(f"cannot write here ({e.strerror or type(e).__name__})", str(path),
                           f"choose a writable {flag}") from None


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse to clobber an existing output unless asked to."""
    if out.exists() and not force:
        raise FlashRLError(
            "output already exists", str(out), "pass --force to replace it or choose another -o"
        )
    if out.exists() and not out.is_dir():
        raise FlashRLError("output path exists and is not a directory", str(out),
                           "remove it or choose another -o")


@contextlib.contextmanager
def atomic_output_dir(out: Path) -> Iterator[Path]:
    """Yield a temp dir beside `out`; on success it replaces `out`, on failure it is removed.

    The temp dir lives in the same parent so the final rename is atomic on one filesystem;
    a crash never leaves a half-written `out` behind.
    """
    out = out.resolve()
    check_writable(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary output dir
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a text file via a temp file in the same directory and a rename."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write a file via a temp file in the same directory and a rename."""
    path = Path(path)
    check_writable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
