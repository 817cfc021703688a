"""Engine versions, declared and checked (issue 72). Each adapter declares the releases it was tested on
(`Capabilities.tested`). At model load the adapter passes the installed version here: a tested one runs as
it always did; any other logs one line (the tested versions, `flashrl verify reload` as the way to check
this one) and runs the start-up self-check, unless FLASHRL_VERSION_CHECK=0:

- the hook table installed every hook this process needs (the adapter's list of what is missing), and
- the served weights pushed back through the sync path (the policy's own BF16 tensors, as a trainer pushes
  them) leave the weight digest -- FP8 KV scales included -- unchanged.

A failed check refuses to serve: the engine does not start, with one line naming what failed. The check's
push is not one of the trainer's syncs: the session's count is restored after it, so the weights' version and
the FP8 KV state are a fresh engine's."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

from flashrl_tools.config.settings import settings
from flashrl_tools.errors import FlashRLError

log = logging.getLogger("flashrl_tools.runtime")
VERIFY = "flashrl verify reload --config C"  # how a user checks a version by hand


def release(version: str) -> str:
    """The release of a version string: '0.32.0+cpu' -> '0.32.0', '0.26.0rc1.dev3' -> '0.26.0'."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return m.group(0) if m else version.strip()


def tested(declared: tuple[str, ...], version: str) -> bool:
    return release(version) in declared


def untested_line(engine: str, version: str, declared: tuple[str, ...]) -> str:
    return (f"flashrl: {engine} {version} is not a version flashrl was tested on ({', '.join(declared)}): a start-up "
            f"self-check runs (FLASHRL_VERSION_CHECK=0 skips it); `{VERIFY}` checks this version's syncs")


def check_at_start(engine: str, version: str, declared: tuple[str, ...], session, rc, loaded_dir, dummy: bool,
                   missing_hooks: Callable[[], list[str]], fingerprint: Callable[[], dict[str, str]]) -> bool:
    """The version check at model load (module docstring): `session` the model's sync session, `rc` / `loaded_dir`
    its config and what the engine loaded (the BF16 policy the served weights come from: `policy_source`), `dummy`
    an engine started without weights (verl's `load_format="dummy"`), `missing_hooks()` the adapter's hooks this
    process lacks (core/hooks.py `missing`), `fingerprint()` the weight digest. Returns whether the self-check ran; raises
    RuntimeError with the one-line refusal when it failed."""
    if tested(declared, version):
        return False
    log.warning(untested_line(engine, version, declared))
    if not settings().version_check:
        log.info("flashrl: start-up self-check skipped (FLASHRL_VERSION_CHECK=0)")
        return False
    absent = missing_hooks()
    problems = [f"hooks not installed: {', '.join(absent)}"] if absent else []
    skip_weights = ("dummy weights (the trainer's first sync brings them)" if dummy else
                    "a calibrated profile reproduces its checkpoint to >= 99.9 % only" if rc.entry.profile else "")
    if skip_weights:
        log.info("flashrl: start-up self-check: the weights' part skipped (%s)", skip_weights)
    elif not problems:
        from flashrl_tools.runtime.core.reload_check import policy_source

        problems += _weights_unchanged(session, policy_source(Path(loaded_dir), rc), fingerprint)
    if problems:
        refusal = FlashRLError(f"{engine} {version} (untested; tested: {', '.join(declared)}) failed flashrl's start-up "
                               f"self-check: {'; '.join(problems)}", None,
                               f"install a tested version, or see `{VERIFY}`; FLASHRL_VERSION_CHECK=0 skips the check")
        raise RuntimeError(f"flashrl: {refusal.message}")
    log.info("flashrl: start-up self-check passed on %s %s (hooks installed%s)", engine, version,
             "" if skip_weights else "; the policy pushed back left the weight digest and the FP8 KV scales unchanged")
    return True


def _weights_unchanged(session, source: Path, fingerprint) -> list[str]:
    """Push `source` through the session; what changed in the digest (weights, FP8 KV scales)."""
    from flashrl_tools.runtime.core.digest import compare, is_kv_scale
    from flashrl_tools.runtime.core.reload_check import push_policy

    before = fingerprint()
    completed = session.state.completed
    try:
        push_policy(session, source)
    except Exception as e:  # noqa: BLE001 -- whatever this version's loaders raise is the check's finding
        return [f"the policy pushed back raised {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"]
    finally:
        session.state.completed = completed  # the check's push is not a trainer's sync
    diff = compare(before, fingerprint())
    changed = diff["differ"] + diff["only_first"] + diff["only_second"]
    scales = [n for n in changed if is_kv_scale(n)]
    weights = [n for n in changed if not is_kv_scale(n)]
    problems = []
    if weights:
        problems.append(f"the policy pushed back changed {len(weights)} of {diff['tensors']} weight tensors "
                        f"(first: {weights[0]})")
    if scales:
        problems.append(f"the policy pushed back changed {len(scales)} FP8 KV scales (first: {scales[0]})")
    if session.status() is not None:
        problems.append(f"the policy pushed back left the sync incomplete ({session.status()})")
    return problems
