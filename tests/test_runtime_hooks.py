"""The hook installer (runtime/core/hooks.py): SGLang's HookRegistry semantics for vLLM's table, async
functions kept async, installed once, optional targets skipped, a missing required target one error."""

from __future__ import annotations

import asyncio
import inspect
import sys
import types

import pytest

from flashrl_tools.runtime.core.adapter import Hook, HookKind
from flashrl_tools.runtime.core.hooks import MARK, install


@pytest.fixture
def engine(monkeypatch):
    """A stand-in engine module `fakeengine.core` with one class."""
    module = types.ModuleType("fakeengine.core")

    class Engine:
        def add(self, x):
            return x + 1

        async def rpc(self, x):
            return x * 2

        async def stream(self, n):
            for i in range(n):
                yield i

    module.Engine = Engine
    package = types.ModuleType("fakeengine")
    package.core = module
    monkeypatch.setitem(sys.modules, "fakeengine", package)
    monkeypatch.setitem(sys.modules, "fakeengine.core", module)
    return Engine


def test_every_kind_wraps_as_sglangs_registry_does(engine):
    seen = []

    def before(self, x):
        seen.append(("before", x))
        return (self, x + 10), {}

    async def around_stream(original, self, n):
        async for i in original(self, n):
            yield -i

    hooks = [Hook("b", "fakeengine.core.Engine.add", before, HookKind.BEFORE, "p", "d"),
             Hook("a", "fakeengine.core.Engine.rpc", lambda result, self, x: result + 1, HookKind.AFTER, "p", "d"),
             Hook("s", "fakeengine.core.Engine.stream", around_stream, HookKind.AROUND, "p", "d"),
             Hook("n", "fakeengine.core.Engine.named", lambda self: "added", HookKind.ADD, "p", "d")]
    assert install(hooks) == []
    e = engine()
    assert e.add(1) == 12 and seen == [("before", 1)]  # BEFORE may change the arguments
    assert inspect.iscoroutinefunction(engine.rpc) and asyncio.run(e.rpc(3)) == 7  # still async
    assert asyncio.run(_collect(e.stream(3))) == [0, -1, -2]
    assert e.named() == "added"
    assert getattr(engine.add, MARK) == "b"
    install(hooks)  # once per process: not wrapped twice
    assert e.add(1) == 12 and len(seen) == 2


async def _collect(gen):
    return [x async for x in gen]


def test_alternatives_optional_targets_and_a_missing_required_one(engine):
    def before(self, x):
        return None

    hook = Hook("alt", "fakeengine.core.Engine.gone|fakeengine.core.Engine.add", before, HookKind.BEFORE, "p", "d")
    assert install([hook]) == [] and getattr(engine.add, MARK) == "alt"  # the first target that exists
    assert install([Hook("opt", "fakeengine.core.Missing.x", before, HookKind.BEFORE, "p", "d", optional=True)]) == ["opt"]
    with pytest.raises(RuntimeError, match="hook req: none of .* exists in this engine build"):
        install([Hook("req", "fakeengine.core.Engine.nope", before, HookKind.BEFORE, "p", "d")])
