"""The one interface between the runtime core and an engine (vLLM, SGLang): what an adapter declares
and what the core asks of it. An adapter (`runtime/<engine>/adapter.py`) is data plus small objects:

- `Capabilities`: what the engine serves (formats, MoE, FP8 KV cache, sleep, push paths) and how it
  honours each FLASHRL_* variable. Start-up refusals read it (plan.py, `check_settings`); the README's
  engine table is rendered from it (tests/test_runtime_contract.py compares them).
- `hooks`: a table of `Hook`s, installed by one function (hooks.py for vLLM; SGLang's HookRegistry),
  the table being the documentation of where the runtime touches the engine.
- for a loaded model: a `ModelWriter` (how converted tensors reach the storage the kernels read; the sync loop
  is session.py's) and, with an FP8 KV cache, `KVLayers` (where its attention keeps the scales; the state is
  kv_state.py's); in the front end, a `KVFront` (how each step of a calibration is done on this engine; the
  protocol is kv_driver.py's `calibrate`). All three below, every method declared.
Everything else -- the sync loop, conversion, the serving plan, KV calibration, admission, settings --
is the core's, written once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol

import torch

from flashrl_tools.config.settings import VARIABLES, Settings
from flashrl_tools.errors import FlashRLError
from flashrl_tools.quant.formats import QuantFn
from flashrl_tools.quant.kernels.w8a8_gemm import MAX_ROWS as DECODE_GEMM_MAX


class HookKind(str, Enum):
    """SGLang's HookType semantics (sglang/srt/plugins/hook_registry.py), plus ADD."""

    BEFORE = "before"  # fn(self, *args, **kwargs) before the original
    AFTER = "after"  # fn(result, self, *args, **kwargs) -> new result or None
    AROUND = "around"  # fn(original, self, *args, **kwargs)
    REPLACE = "replace"  # fn(self, *args, **kwargs) instead of the original
    ADD = "add"  # a new attribute (a named method for RPCs): the target must not exist yet


@dataclass(frozen=True)
class Hook:
    name: str
    target: str  # "package.module.Class.attribute"; alternatives for other versions: "...a|...b"
    fn: Callable
    kind: HookKind
    process: str  # where it runs: front end, worker, scheduler, ...
    does: str  # what it does (the table is the documentation)
    optional: bool = False  # the target exists only in some builds / versions: skipped where absent
    always: bool = False  # installed without FLASHRL_CONFIG too (a refusal that must still run)

    @property
    def targets(self) -> list[str]:
        return self.target.split("|")


@dataclass(frozen=True)
class Setting:
    """How an engine honours one FLASHRL_* variable."""

    how: str  # what it does on this engine, or why a value is refused
    values: tuple[str, ...] | None = None  # the values honoured (others refused); None: every value


@dataclass(frozen=True)
class Capabilities:
    engine: str  # as users name it: "vLLM", "SGLang"
    versions: str
    tested: tuple[str, ...]  # the releases the tests ran on: any other runs the start-up self-check (core/versions.py)
    formats: frozenset[QuantFn]  # checkpoint formats served (dense models)
    formats_note: str  # why others are not, or what is not run yet ("": nothing to say)
    moe_formats: frozenset[QuantFn]  # formats served for MoE experts
    moe_note: str
    fp8_dense: QuantFn | None  # how FLASHRL_CONFIG=fp8 is served on dense models (None: the engine's online FP8)
    fp8_moe: QuantFn  # ... and on MoE models (our per-channel FP8 checkpoint on both engines)
    checkpoint_quantization: str  # the engine's `quantization` name for the checkpoints it loads
    online_quantization: tuple[str, ...]  # ... and for its own online FP8 (empty: none)
    fp8_kv_cache: bool
    kv_scales: tuple[str, ...]  # the scales its FP8 KV cache uses (its KVLayers' kinds)
    fp8_kv_note: str  # which scales, when they are recalibrated
    kv_dtype_names: dict[str, str]  # the config's KV dtype -> the engine's name for it
    lmhead_fp32: str  # the engine's switch FLASHRL_LMHEAD_FP32 sets
    sleep: str  # sleep / release of the weights and what the runtime does about it
    push_paths: tuple[str, ...]  # how trainers push weights into it (all exact)
    in_flight: str  # updates while requests are in flight (pause modes) and what is exact
    logprobs: str  # which distribution the rollout logprobs come from
    logprobs_modes: tuple[str, ...]  # the config `logprobs_mode` values it honours
    settings: dict[str, Setting] = field(default_factory=dict)  # every FLASHRL_* variable

    def kv_dtype(self, config_dtype: str) -> str:
        return self.kv_dtype_names.get(config_dtype, config_dtype)


INPLACE_VALUES = ("1", "0", "tp")

# FLASHRL_* variables whose effect is the same on every engine (read by the config, the quantizer, the
# core's session); an adapter adds how it honours the engine-specific ones.
COMMON_SETTINGS = {
    "FLASHRL_CONFIG": Setting("the config: the engine starts from its serving plan (core/plan.py)"),
    "FLASHRL_CONFIG_INDEX": Setting("which entry of a multi-config YAML"),
    "FLASHRL_HOME": Setting("where online-quantized checkpoints and Hub configs are cached"),
    "FLASHRL_LOGGING_LEVEL": Setting("the runtime's log level in every engine process"),
    "FLASHRL_LOGGING_FILE": Setting("the runtime's log file in every engine process"),
    "FLASHRL_TEST_RELOAD": Setting("at start, the policy's own weights pushed through the sync session; changes "
                                   "logged"),
    "FLASHRL_SYNC_TIMING": Setting("each sync's conversion timed with device synchronisation"),
    "FLASHRL_CODE_CHANGES": Setting("per sync, the share of 4-bit codes it changed, logged (keeps the last codes: "
                                    "0.5 byte a 4-bit weight)"),
    "FLASHRL_DEBUG_STACKS": Setting("DIR: every engine process writes its threads' Python stacks to DIR/PID.stacks "
                                    "on SIGUSR1 and lists its PID in DIR (logs.signal_stacks)"),
    "FLASHRL_TRITON": Setting("the fused Triton INT8 quantizer on CUDA (0: torch)"),
    "FLASHRL_ALLOW_LEGACY_PICKLE": Setting("a Hub config's flash-llm-rl .pt profile accepted"),
    "FLASHRL_VERSION_CHECK": Setting("0: no start-up self-check on an engine version not declared tested (the "
                                     "warning line stays; core/versions.py)"),
}


def check_settings(caps: Capabilities, s: Settings, source: str) -> None:
    """Refuse at start a FLASHRL_* value this engine does not honour (never silently ignored)."""
    if s.inplace_sync not in INPLACE_VALUES:
        raise FlashRLError(f"invalid FLASHRL_INPLACE_SYNC={s.inplace_sync!r}", source,
                           f"allowed: {' | '.join(INPLACE_VALUES)} (or 0 / false / off), or unset")
    if not (s.decode_gemm == "auto" or s.decode_gemm.isdigit() and int(s.decode_gemm) <= DECODE_GEMM_MAX):
        raise FlashRLError(f"invalid FLASHRL_DECODE_GEMM={s.decode_gemm!r}", source,
                           f"allowed: a row count 1..{DECODE_GEMM_MAX} (on: {DECODE_GEMM_MAX}), 0 / off, or unset / auto "
                           "(16 on Hopper GPUs)")
    if s.step_log and not Path(s.step_log).expanduser().parent.is_dir():
        raise FlashRLError(f"FLASHRL_STEP_LOG={s.step_log}: its directory does not exist", source,
                           "create the directory, or unset FLASHRL_STEP_LOG")
    if s.decode_attn not in ("auto", "1", "0", "xqa", "fp8qk", "lpt", "balanced"):
        raise FlashRLError(f"invalid FLASHRL_DECODE_ATTN={s.decode_attn!r}", source,
                           "allowed: 1 / on, 0 / off, xqa (XQA's FP8 kernel from 32 sequences up, Hopper), fp8qk "
                           "(flashrl's kernel with FP8 score products, Hopper), lpt (flashrl's kernel, sequences "
                           "longest first), balanced (its key tiles balanced over a fixed grid, <= 32 sequences), or "
                           "unset / auto (on Hopper GPUs)")
    for var, (attr, _default) in VARIABLES.items():
        setting = caps.settings.get(var)
        raw = getattr(s, attr)
        value = str(int(raw)) if isinstance(raw, bool) else str(raw)  # a switch reads 1 / 0
        if setting is None:
            raise FlashRLError(f"{caps.engine} adapter declares nothing for {var}", source,
                               "a runtime bug: every FLASHRL_* variable must be declared by every adapter")
        if setting.values is not None and value not in setting.values:
            raise FlashRLError(f"{var}={value} is not honoured on {caps.engine}: {setting.how}", source,
                               f"on {caps.engine} use {' | '.join(setting.values)}, or unset {var}")


def hook_table(hooks) -> str:
    """An adapter's hook table as markdown (docs/internals/<engine>.md)."""
    rows = [f"| {h.name} | `{h.target.replace('|', '` / `')}` | {h.kind.value} | {h.process} | {h.does} |"
            for h in hooks]
    return "\n".join(["| hook | target | kind | process | what it does |", "| --- | --- | --- | --- | --- |", *rows])


# -- what the core asks of an adapter's objects ------------------------------------------------------

@dataclass
class Converted:
    """One trainer tensor after conversion: the checkpoint tensors the engine loads, and the trainer's
    own tensors they came from (a writer that keeps tensors past the call must not keep views of
    those: trainers reuse their buffers)."""

    tensors: list[tuple[str, torch.Tensor]]
    sources: list[torch.Tensor]


class ModelWriter(Protocol):
    """The adapter's side of a sync: how converted tensors reach the storage its kernels read."""

    def begin(self, reopen: bool) -> None:
        """A sync opens. `reopen`: the previous one never completed (close what it left half-loaded)."""

    def load(self, converted: Iterator[Converted], *args, **kwargs) -> set[str]:
        """Write these tensors (a run of one sync); returns the engine parameter names loaded."""

    def finish(self) -> None:
        """Every expected tensor has arrived: whatever the engine does after a full load."""


class KVLayers(Protocol):
    """The adapter's attention layers with an FP8 KV cache."""

    kinds: tuple[str, ...]  # the scales the engine's FP8 cache uses: ("q", "k", "v") or ("k", "v")
    layers: dict[str, torch.nn.Module]

    def read(self, layer: torch.nn.Module) -> dict[str, float]: ...

    def write(self, layer: torch.nn.Module, scales: dict[str, float]) -> None:
        """In place (captured graphs keep the tensors' addresses), with any float copies."""

    def inputs(self, layer: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
        """The kinds' tensors of one forward pre-hook call, padding rows cut off."""

    def eager(self, on: bool) -> None:
        """While calibrating, forwards run eagerly (a compiled or captured graph skips the hooks)."""

    def changed(self) -> None:
        """New scales were written (an engine that bakes them into captured graphs captures again)."""

    def rescale(self, layer: torch.nn.Module, old: dict[str, float], new: dict[str, float], kept) -> None:
        """Re-encode the FP8 entries of the requests kept across an update (`kept`: the adapter's
        description of their blocks), written with `old`, for `new`, in place (kv_math.rescale_fp8_
        on the engine's K and V halves)."""


class KVFront:
    """The adapter's front end: how each step of a calibration is done on its engine (every method a coroutine; a
    synchronous engine's return at once). `calibrate` below is the one protocol; an adapter subclasses this and
    implements every method without a default."""

    def lock(self) -> contextlib.AbstractAsyncContextManager:
        raise NotImplementedError

    def aside(self) -> contextlib.AbstractAsyncContextManager[int | None]:
        """Set the requests in flight aside for the calibration (frozen, their KV blocks kept), and
        bring them back after it: yields how many, or None where the engine cannot (then the
        calibration waits for them to finish)."""
        raise NotImplementedError

    async def stale(self) -> bool:
        """Whether the scales may not be those of the current weights."""
        raise NotImplementedError

    async def in_flight(self) -> int:
        """Requests the engine is still serving."""
        raise NotImplementedError

    async def flush(self) -> bool:
        raise NotImplementedError

    def sequences(self) -> list[list[int]]:
        """The calibration token ids for this engine (kv_math.calibration_inputs)."""
        raise NotImplementedError

    async def arm(self) -> None:
        raise NotImplementedError

    async def prefill(self, ids: list[int], rid: str) -> bool:
        """One calibration sequence, one token generated; False if the engine aborted it."""
        raise NotImplementedError

    async def prefill_all(self, items: list[tuple[list[int], str]]) -> bool | None:
        """Every calibration sequence sent at once, the engine still prefilling each in a batch of its own (a fresh
        engine's batches: the same kernels' results) and in order; False if it aborted any; None (this default):
        the engine takes them one `prefill` at a time. Saves a round trip per sequence (SGLang: scheduler.py
        `one_calibration_per_batch`)."""
        return None

    async def write_scales(self, token: str, rescale: bool) -> bool:
        """The model side writes the calibrated scales; False if they were not written. `rescale`: requests set
        aside hold entries of the old scales (re-encoded for the new ones)."""
        raise NotImplementedError

    async def abandon(self, token: str, rescale: bool) -> None:
        """The calibration failed: the model side goes back to the scales in use (requests set aside go on with
        them)."""
        raise NotImplementedError

    def calibrated(self) -> None:
        """The calibration completed: the scales are those of the current weights."""
