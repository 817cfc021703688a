"""Request admission, for every engine: a request is refused (in the caller, the engine stays up to
receive the rest of the weights) while any rank's weights are incomplete -- a sync in progress or
failed, the weights discarded by a sleep -- and, where the model's process sees each request, while
its FP8 KV scales are not those of its weights (`KVScaleState.refusal`). The reasons come from the sync sessions
(session.py) and KV states (kv_state.py); where a request enters is the adapter's."""

from __future__ import annotations

from collections.abc import Iterable

from flashrl_tools.runtime.core.session import SyncIncomplete


def refusal(reasons: Iterable[str | None]) -> str | None:
    """The first reason to refuse (one per rank), or None to admit."""
    return next((r for r in reasons if r), None)


def admit(reasons: Iterable[str | None]) -> None:
    """Raise SyncIncomplete with the first reason to refuse."""
    reason = refusal(reasons)
    if reason is not None:
        raise SyncIncomplete(reason)

