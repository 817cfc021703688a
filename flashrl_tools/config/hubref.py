"""Hub references as users write them, parsed once into typed values.

- a config: `USER/NAME/path/to/config.yaml[@REVISION]` (what FLASHRL_CONFIG may say)
- a model:  `USER/NAME[@REVISION]` (the `model` of a published config: a checkpoint on the Hub)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = r"[\w.-]+"
_CONFIG_REF = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})/(?P<path>[^@]+\.ya?ml)(?:@(?P<rev>[\w./-]+))?$")
_MODEL_REF = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?:@(?P<rev>[\w./-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    path: str | None  # file in the repo (None: the whole repo, e.g. a model)
    revision: str | None = None  # branch, tag or commit sha; None: the default branch

    @property
    def pinned(self) -> bool:
        """Pinned to a commit: what it names can never change."""
        return self.revision is not None and bool(_COMMIT.match(self.revision))

    def __str__(self) -> str:
        text = self.repo_id + (f"/{self.path}" if self.path else "")
        return text + (f"@{self.revision}" if self.revision else "")


def parse_config_ref(value: str) -> HubRef | None:
    m = _CONFIG_REF.match(value.strip())
    if m is None or ".." in m["path"].split("/"):
        return None
    return HubRef(m["repo"], m["path"], m["rev"])


def parse_model_ref(value: str) -> HubRef | None:
    m = _MODEL_REF.match(value.strip())
    return HubRef(m["repo"], None, m["rev"]) if m else None


def is_repo_id(value: str) -> bool:
    return bool(re.fullmatch(rf"{_NAME}/{_NAME}", value))
