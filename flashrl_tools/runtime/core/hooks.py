"""Install an adapter's hook table: each `Hook` wraps (or adds) one attribute of an engine class, once
per process, with SGLang's HookRegistry semantics (core/adapter.py `HookKind`). vLLM has no hook
registry: its table is installed here. SGLang's table goes to SGLang's own registry (ADD entries,
which it has no kind for, come here)."""

from __future__ import annotations

import functools
import inspect
import logging
import pkgutil
import threading

from flashrl_tools.runtime.core.adapter import Hook, HookKind

log = logging.getLogger("flashrl_tools.runtime")
_installed: set[str] = set()
_skipped: set[str] = set()  # hooks whose target this build lacks (optional ones)
_tables: dict[str, tuple[Hook, ...]] = {}  # each adapter's hook table, declared when its module loads
_lock = threading.Lock()
MARK = "_flashrl_hook"  # set on every wrapper: the name of the hook that made it


def resolve(hook: Hook) -> tuple[object, str] | None:
    """(owner, attribute) of the first of the hook's targets that exists in this build, else None."""
    for target in hook.targets:
        owner_path, attr = target.rsplit(".", 1)
        try:
            owner = pkgutil.resolve_name(owner_path)
        except (ImportError, AttributeError):
            continue
        if hook.kind is HookKind.ADD or hasattr(owner, attr):
            return owner, attr
    return None


def wrap(original, hook: Hook):
    """The wrapper of one hook around `original` (functions, coroutine and async-generator functions)."""
    fn, kind = hook.fn, hook.kind
    if kind is HookKind.REPLACE:
        wrapper = fn
    elif kind is HookKind.BEFORE:
        def before(args, kwargs):
            changed = fn(*args, **kwargs)
            return (args, kwargs) if changed is None else changed  # (args, kwargs) to call the original with

        if inspect.iscoroutinefunction(original):  # stays a coroutine function for callers that check
            async def wrapper(*args, **kwargs):
                args, kwargs = before(args, kwargs)
                return await original(*args, **kwargs)
        else:
            def wrapper(*args, **kwargs):
                args, kwargs = before(args, kwargs)
                return original(*args, **kwargs)
    elif kind is HookKind.AFTER:
        if inspect.iscoroutinefunction(original):
            async def wrapper(*args, **kwargs):
                result = await original(*args, **kwargs)
                changed = fn(result, *args, **kwargs)
                return result if changed is None else changed
        else:
            def wrapper(*args, **kwargs):
                result = original(*args, **kwargs)
                changed = fn(result, *args, **kwargs)
                return result if changed is None else changed
    elif kind is HookKind.AROUND:
        if inspect.isasyncgenfunction(fn):
            async def wrapper(*args, **kwargs):
                async for item in fn(original, *args, **kwargs):
                    yield item
        elif inspect.iscoroutinefunction(fn):
            async def wrapper(*args, **kwargs):
                return await fn(original, *args, **kwargs)
        else:
            def wrapper(*args, **kwargs):
                return fn(original, *args, **kwargs)
    else:
        raise ValueError(f"{hook.name}: {kind} hooks are added, not wrapped")
    if kind is not HookKind.REPLACE:
        wrapper = functools.wraps(original)(wrapper)
    setattr(wrapper, MARK, hook.name)
    return wrapper


def install(hooks, registry=None, hook_type=None) -> list[str]:
    """Install each hook once per process. With an engine registry (SGLang's HookRegistry and its
    HookType), wrapping hooks are registered there (each call: the registry applies them once) and only
    ADD hooks are installed here. Returns the
    names of the hooks whose target this build does not have (optional ones)."""
    skipped = []
    with _lock:
        for hook in hooks:
            if registry is not None and hook.kind is not HookKind.ADD:  # (SGLang loads plugins once)
                registry.register(hook.target, hook.fn, getattr(hook_type, hook.kind.name))
                continue
            key = f"{hook.name}:{hook.target}"
            if key in _installed:
                continue
            found = resolve(hook)
            if found is None:
                if not hook.optional:
                    raise RuntimeError(f"flashrl: hook {hook.name}: none of {hook.targets} exists in this "
                                       "engine build (an unsupported version?)")
                skipped.append(hook.name)
                _skipped.add(hook.name)
                _installed.add(key)
                continue
            owner, attr = found
            if hook.kind is HookKind.ADD:
                setattr(owner, attr, hook.fn)
            else:
                original = inspect.getattr_static(owner, attr)
                if getattr(original, MARK, None) != hook.name:
                    setattr(owner, attr, wrap(getattr(owner, attr), hook))
            _installed.add(key)
    if skipped:
        log.debug("flashrl: hooks without a target in this build: %s", ", ".join(skipped))
    return skipped


def declare(engine: str, hooks: tuple[Hook, ...]) -> tuple[Hook, ...]:
    """An adapter's hook table, kept for the checks that run where the adapter module cannot be imported (its
    writer's start-up self-check: the adapter imports the writer)."""
    _tables[engine] = tuple(hooks)
    return _tables[engine]


def declared(engine: str) -> tuple[Hook, ...]:
    return _tables.get(engine, ())


def missing(hooks, other_platform: str = "", registry: bool = False) -> list[str]:
    """The hooks of `hooks` this process needs and does not have (the start-up self-check on an untested engine
    version, core/versions.py): one whose target this build lacks -- an optional one too, unless its process names
    `other_platform` ("GPU" / "CPU": a hook of the other build) -- or whose wrapper is no longer at its target
    (`registry`: the engine's registry wrapped the non-ADD hooks; their targets must exist)."""
    out = []
    for hook in hooks:
        if other_platform and other_platform in hook.process:
            continue
        found = resolve(hook)
        if found is None or hook.name in _skipped:
            out.append(hook.name)
            continue
        if registry and hook.kind is not HookKind.ADD:
            continue
        owner, attr = found
        current = inspect.getattr_static(owner, attr, None)
        if current is not hook.fn and getattr(current, MARK, None) != hook.name:
            out.append(hook.name)
    return out
