"""In-flight weight updates, the rules both engines follow (asynchronous RL; issue 73):

- the weights' version a request is admitted under -- the complete syncs of the process's models -- and the
  prefix-cache salt that keeps the versions apart: a request's key is its caller's salt with the version
  appended, so nothing admitted after an update reuses a cached block computed by the old weights, while
  requests kept in flight keep theirs (vLLM's `cache_salt`, SGLang's radix namespace `Req.extra_key`);
- a resume (vLLM's `resume_generation`, SGLang's `continue_generation`) before every rank's sync completed is
  refused: the engine stays paused with the requests the pause kept (none aborted, none decoding on
  half-updated weights), the trainer pushes the rest and resumes again; new requests are refused while the
  weights are incomplete (core/admission.py). vLLM raises the message to the caller; SGLang's continue is
  fire-and-forget, so its schedulers log it."""

from __future__ import annotations

from collections.abc import Iterable

from flashrl_tools.runtime.core.admission import refusal

SALT = "flashrl-weights-"


def weights_version(sessions: Iterable) -> int:
    """The weights' version of a process: the syncs its models' sessions completed."""
    return sum(s.completed for s in sessions)


def salted(caller: str | None, tag: str) -> str:
    """The caller's salt with `tag` appended (`tag` alone where the caller gave none)."""
    return tag if caller is None else f"{caller}|{tag}"


def version_salt(caller: str | None, version: int) -> str:
    """The prefix-cache key of a request admitted under `version`."""
    return salted(caller, f"{SALT}{version}")


def resume_refusal(reasons: Iterable[str | None]) -> str | None:
    """Why a resume must be refused (one reason per rank: the sessions' status), or None to resume."""
    problem = refusal(reasons)
    if problem is None:
        return None
    return (f"flashrl: generation resumed before the weight sync completed ({problem}); the engine stays paused "
            "with the requests it kept: push the rest of the weights, then resume")
