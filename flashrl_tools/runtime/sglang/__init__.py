"""The SGLang adapter of the runtime: every module that touches SGLang is in this package, as
runtime/vllm/ is for vLLM. adapter.py declares what SGLang serves and the hook table (registered with
SGLang's HookRegistry); plugin.py is SGLang's entry point (`sglang.srt.plugins`); server_args.py (the
serving plan into ServerArgs), weight_sync.py (the `ModelWriter`: SGLang's own loader into the storage
its kernels read), scheduler.py (admission, sleep, refused update paths), kv_scales.py (where attention
keeps its FP8 KV scales), kv_front.py (the KV calibration front end). Importing this package changes
nothing."""
