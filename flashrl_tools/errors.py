"""User-facing errors: what went wrong, where, and what to do about it.

Library code raises `FlashRLError`; the CLI edge turns it into one line on stderr and a
non-zero exit code. Anything else reaching the edge is a bug and keeps its traceback.
"""

from __future__ import annotations


class FlashRLError(Exception):
    """An error caused by the user's input or environment, not by a bug."""

    exit_code = 2

    def __init__(self, what: str, where: str | None = None, fix: str | None = None):
        self.what, self.where, self.fix = what, where, fix
        super().__init__(self.message)

    @property
    def message(self) -> str:
        parts = [self.what]
        if self.where:
            parts.append(f"({self.where})")
        msg = " ".join(parts)
        if self.fix:
            msg += f"; {self.fix}"
        return msg
