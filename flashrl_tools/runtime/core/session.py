"""The sync session: whether an engine holds one complete set of weights, and the loop that takes a
trainer's tensors into it. Engine-neutral: the engine is reached through its adapter's `ModelWriter`.

A sync is the set of checkpoint tensors `expected`; it opens with its first tensor and completes when
every expected name has arrived. Until then, or after a failed sync, or after the engine discarded its
weights (vLLM's `sleep(level=2)`, SGLang's `release_memory_occupation` without a CPU backup), the
engine must refuse to generate: `check_ready` raises `SyncIncomplete` with what the trainer has to do.

One call of `SyncSession.load_weights` (whatever the trainer's push path: one tensor per call, buckets,
the engine's own reload) takes the trainer's (name, tensor) pairs: each becomes its checkpoint-named
tensors (fused MoE experts split, renamed modules mapped back), is converted to what the engine serves
(convert.py), and goes to the writer. A name arriving a second time in one sync (a trainer retrying
after a partial or failed push) starts a new sync: the writer is told so before it receives it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from flashrl_tools.config.settings import settings
from flashrl_tools.runtime.core.adapter import Converted, ModelWriter
from flashrl_tools.runtime.core.code_changes import CodeChanges
from flashrl_tools.runtime.core.convert import WeightConverter

log = logging.getLogger("flashrl_tools.runtime")


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


class SyncSession:
    """Replaces the `load_weights` of a model the engine loaded: the one sync loop of every engine."""

    def __init__(self, model: torch.nn.Module, converter: WeightConverter, writer: ModelWriter,
                 engine: str, rank: int = 0):
        self.model, self.converter, self.writer = model, converter, writer
        self.engine, self.rank = engine, rank  # for the weight digest (FLASHRL_SYNC_DIGEST)
        self.state = SyncState(frozenset(converter.expected))
        self.ignored: set[str] = set()
        self.timing = settings().sync_timing
        self.convert_seconds = 0.0  # time spent converting (quantizing) tensors, all syncs
        self.load_seconds = 0.0  # time in the writer (converting included), all syncs
        self._at_begin = (0.0, 0.0)  # both at the start of the sync in progress
        self.code_changes = CodeChanges() if settings().code_changes else None  # FLASHRL_CODE_CHANGES

    @property
    def completed(self) -> int:
        return self.state.completed

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *args, **kwargs) -> set[str]:
        try:
            return self._load_weights(weights, *args, **kwargs)
        except Exception:  # refused (a pre-quantized tensor is refused before any sync opens): nothing carries over
            self.converter.end_push()
            raise

    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *args, **kwargs) -> set[str]:
        pending = self.converter.checkpoint_groups(weights, self.ignored)  # one list per trainer tensor
        loaded: set[str] = set()
        while (first := next(pending, None)) is not None:
            names = [name for name, _ in first]
            if self.state.must_begin(names):
                if self.state.active and not self.state.failed:
                    log.warning("flashrl: %s received twice; starting the weight sync over", names[0])
                self.writer.begin(reopen=self.state.active)
                self.state.begin()
                self._at_begin = (self.convert_seconds, self.load_seconds)
            repeated: list = []
            try:
                converted = self._convert(self._run(itertools.chain([first], pending), repeated))
                t0 = time.perf_counter()
                loaded |= set(self.writer.load(converted, *args, **kwargs) or ())
                if self.timing and first[0][1].is_cuda:
                    torch.cuda.synchronize(first[0][1].device)
                self.load_seconds += time.perf_counter() - t0
            except Exception as e:
                self.state.fail(f"{type(e).__name__}: {e}")
                raise
            pending = itertools.chain(repeated, pending)
            if self.state.active and self.state.done():
                try:
                    self._complete()
                except Exception as e:  # the writer's last step (e.g. a layout recomputed) failed: not a sync
                    self.state.fail(f"{type(e).__name__}: {e}")
                    raise
        return loaded

    def _run(self, groups: Iterator[list], repeated: list) -> Iterator[list]:
        """The groups of one sync: stops before a name this sync has already received."""
        for group in groups:
            if any(name in self.state.seen for name, _ in group):
                repeated.append(group)
                return
            self.state.receive(name for name, _ in group)
            yield group

    def _convert(self, groups: Iterator[list]) -> Iterator[Converted]:
        for group in groups:
            t0 = time.perf_counter()
            tensors = self.converter.convert_group(group)
            if self.code_changes is not None:
                self.code_changes.observe(tensors)
            if self.timing and group[0][1].is_cuda:  # FLASHRL_SYNC_TIMING: wait for the device
                torch.cuda.synchronize(group[0][1].device)
            self.convert_seconds += time.perf_counter() - t0
            yield Converted(tensors, [t for _, t in group])

    def _complete(self) -> None:
        from flashrl_tools.runtime.core.digest import write_after_sync

        self.writer.finish()
        self.converter.end_push()
        self.state.complete()
        timed = ""
        if self.timing:  # FLASHRL_SYNC_TIMING: where this sync's time went (device synchronised)
            convert = self.convert_seconds - self._at_begin[0]
            timed = f"; convert {convert:.3f} s, write {self.load_seconds - self._at_begin[1] - convert:.3f} s"
        log.info("flashrl: weight sync %d complete (%d tensors%s)", self.state.completed, len(self.state.seen), timed)
        if self.code_changes is not None:
            log.info("flashrl: weight sync %d: %s", self.state.completed, self.code_changes.summary())
        write_after_sync(self.model, self.state.completed, self.engine, self.rank)  # FLASHRL_SYNC_DIGEST

    def status(self) -> str | None:
        """None when the engine holds one complete set of weights, else why not."""
        return self.state.status()

    def check_ready(self) -> None:
        self.state.check_ready()

    def discard(self, reason: str) -> None:
        """The engine's weights are gone: refuse until a full sync, and drop device tensors the
        converter cached (they may live in the discarded memory)."""
        self.state.discard(reason)
        self.converter.drop_device_cache()
        log.info("flashrl: weights discarded (%s); the engine refuses requests until a full weight sync", reason)


def open_session(model: torch.nn.Module, loaded_dir, rc, writer_for, engine: str, rank: int = 0) -> SyncSession:
    """The session for a model the engine loaded from `loaded_dir` under config `rc`. `writer_for(converter)`:
    the adapter's writer. With FLASHRL_TEST_RELOAD set, the policy's own weights go through it at once."""
    from pathlib import Path

    converter = WeightConverter.for_checkpoint(rc.fn, Path(loaded_dir), rc.entry.profile)
    session = SyncSession(model, converter, writer_for(converter), engine, rank)
    if settings().test_reload:
        from flashrl_tools.runtime.core.reload_check import policy_source, reload_check

        reload_check(session, policy_source(Path(loaded_dir), rc))
    return session
