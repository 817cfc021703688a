"""SGLang's `ServerArgs` (engine / launcher process): the core's serving plan (core/plan.py) written into
SGLang's argument names -- `model_path`, `tokenizer_path`, `kv_cache_dtype`, `enable_fp32_lm_head` --
plus what only SGLang needs: its own online FP8 (`load_format="flash_rl"`) refused next to a config,
the pool by 16-token pages where flashrl's FP8 decode kernel reads it (`page_size`, left unset by the caller,
with an FP8 E4M3 cache on fa3 and FLASHRL_DECODE_ATTN not 0: the kernel then reads contiguous pages instead of
one scattered slot a token, 2.7 % off the 14B step; RESULTS "SGLang's 14B step by band"), and the late
application to ServerArgs built before the plugins loaded (verl)."""

from __future__ import annotations

import logging

from flashrl_tools.config.resolve import RuntimeConfig
from flashrl_tools.config.settings import settings
from flashrl_tools.errors import FlashRLError
from flashrl_tools.runtime.core.plan import start

log = logging.getLogger("flashrl_tools.runtime")


PAGE_SIZE = 16  # SGLang's pool under flashrl's FP8 decode kernel (64 measured no better)


def default_page_size(args, kv_cache_dtype) -> bool:
    """Whether the pool takes PAGE_SIZE: the caller left `page_size` unset (None: before SGLang resolves it), the
    cache is FP8 E4M3, the attention backend is fa3 (where flashrl's kernel takes the decode batches; it runs on
    Hopper only) and FLASHRL_DECODE_ATTN is not 0."""
    return (getattr(args, "page_size", 0) is None and str(kv_cache_dtype) == "fp8_e4m3"
            and getattr(args, "attention_backend", None) == "fa3" and settings().decode_attn != "0")


def apply_plan(rc: RuntimeConfig, args) -> dict:
    """Change `args` (a ServerArgs) in place; returns what changed."""
    from flashrl_tools.runtime.sglang.capabilities import CAPABILITIES

    if getattr(args, "load_format", "auto") == "flash_rl":
        raise FlashRLError(f"load_format='flash_rl' (SGLang's own online FP8) and FLASHRL_CONFIG={rc.source} "
                           "would both quantize the pushed weights", None, "drop load_format, or unset FLASHRL_CONFIG")
    plan = start(rc, args.model_path, CAPABILITIES, getattr(args, "quantization", None),
                 getattr(args, "kv_cache_dtype", None))
    changed: dict = {}
    if plan.checkpoint is not None:
        changed["model_path"] = plan.checkpoint
        if not args.tokenizer_path:  # the caller's own tokenizer stays
            changed["tokenizer_path"] = plan.tokenizer
    if plan.kv_cache_dtype is not None:
        changed["kv_cache_dtype"] = plan.kv_cache_dtype
    if plan.lmhead_fp32:
        changed["enable_fp32_lm_head"] = True
    if default_page_size(args, changed.get("kv_cache_dtype", getattr(args, "kv_cache_dtype", None))):
        changed["page_size"] = PAGE_SIZE
    if getattr(args, "_declarations_materialized", False) and hasattr(args, "override"):
        # SGLang 0.5.17 freezes ServerArgs after __post_init__: a late application (verl builds the
        # arguments before the plugins load) goes through its one mutation point
        args.override("flashrl_tools", **changed)
    else:
        for key, value in changed.items():
            setattr(args, key, value)
    return changed


def server_args(args, *_, **__) -> None:
    """BEFORE `ServerArgs.__post_init__` (Engine, launch_server: plugins load before the arguments are
    built) and before `check_server_args` (verl's server builds ServerArgs itself and loads the plugins
    only in `Engine._launch_subprocesses`, after it): the first one that runs applies the config.
    Installed without FLASHRL_CONFIG too: SGLang loads plugins once per process, so an engine whose
    environment changed since is refused here."""
    from flashrl_tools.runtime.core.process import check_env, config

    if getattr(args, "_flashrl_applied", False):
        return
    check_env("SGLang")
    rc = config()
    if rc is None:
        return  # no FLASHRL_CONFIG: plain SGLang
    try:
        changed = apply_plan(rc, args)
    except FlashRLError as e:  # SGLang logs a plugin's exception; here it stops the engine
        raise RuntimeError(f"flashrl: {e.message}") from None
    args._flashrl_applied = True
    if changed:
        log.info("flashrl %s: SGLang server args %s", rc.fn.value, changed)
