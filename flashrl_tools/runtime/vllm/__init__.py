"""The vLLM adapter of the runtime: every module that touches vLLM is in this package, so a new vLLM
version changes this package only. adapter.py declares what vLLM serves and the hook table; plugin.py
is vLLM's entry point; engine_args.py (the serving plan into EngineArgs), weight_sync.py (the
`ModelWriter`: in place or vLLM's layerwise reload), inplace.py / layouts.py / slots.py (the in-place
fast path), requests.py (request entry, worker RPCs, the KV calibration front ends), kv_scales.py
(where attention keeps its FP8 KV scales), sleep.py (sleep mode), fixes.py (vLLM bugs on reload).
Importing this package changes nothing."""
