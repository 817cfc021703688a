"""Whether an engine holds one complete set of weights: the state of weight syncs, for any engine.

No engine imports here (vLLM now, SGLang next use the same rules). A sync is the set of checkpoint
tensors `expected`; it opens with its first tensor and completes when every expected name has
arrived. Until then, or after a failed sync, or after the engine discarded its weights (vLLM's
`sleep(level=2)`), the engine must refuse to generate: `check_ready` raises `SyncIncomplete` with
what the trainer has to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class SyncIncomplete(RuntimeError):
    pass


@dataclass
class SyncState:
    expected: frozenset[str]
    active: bool = False  # a sync has started and not completed
    failed: str | None = None  # why the last sync failed (it must start over)
    discarded: str | None = None  # why the engine's weights are gone (a full sync brings them back)
    completed: int = 0  # complete syncs so far
    seen: set[str] = field(default_factory=set)  # names received in the open sync

    def must_begin(self, names) -> bool:
        """Whether these names open a new sync: none is open, the last one failed, or a name
        arrives a second time (a trainer retrying after a partial or failed push)."""
        return not self.active or self.failed is not None or any(n in self.seen for n in names)

    def begin(self) -> None:
        self.active, self.failed, self.seen = True, None, set()

    def receive(self, names) -> None:
        self.seen.update(names)

    def done(self) -> bool:
        return self.expected <= self.seen

    def complete(self) -> None:
        self.active, self.failed, self.discarded = False, None, None
        self.completed += 1

    def fail(self, reason: str) -> None:
        self.failed = reason

    def discard(self, reason: str) -> None:
        """The engine's weights are gone (freed memory, zeroed or garbage when mapped again).
        A sync in progress cannot finish either: what it loaded is gone too."""
        self.discarded = reason
        if self.active:
            self.failed = reason

    def check_ready(self) -> None:
        if self.discarded:
            raise SyncIncomplete(f"flashrl: the engine's weights were discarded ({self.discarded}); it refuses to "
                                 f"generate until a full weight sync (all {len(self.expected)} tensors) has arrived"
                                 + (f" ({len(self.seen)} received so far)" if self.active and not self.failed else ""))
        if self.failed:
            raise SyncIncomplete(f"flashrl: the last weight sync failed ({self.failed}); the engine refuses "
                                 "to generate until a full sync succeeds")
        if self.active:
            missing = sorted(self.expected - self.seen)
            raise SyncIncomplete(f"flashrl: weight sync incomplete: {len(missing)} of {len(self.expected)} "
                                 f"tensors not received yet (first: {missing[0]}); push all weights before "
                                 "generating")

    def status(self) -> str | None:
        """None when the engine holds one complete set of weights, else why not."""
        try:
            self.check_ready()
        except SyncIncomplete as e:
            return str(e)
        return None
