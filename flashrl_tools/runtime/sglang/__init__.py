"""The SGLang coupling of the runtime (issue 32): every module that touches SGLang internals is in this
package, as runtime/vllm/ is for vLLM. SGLang runs `flashrl_tools.runtime.sglang.plugin:register`
(entry point group `sglang.srt.plugins`) in the engine, the server launcher and every scheduler (TP
rank) process; `register` adds the hooks of `plugin.HOOKS` to SGLang's `HookRegistry`, which applies
them. Importing this package changes nothing. Written against SGLang 0.5.17; GPU-checked on an H100 (RESULTS "SGLang backend").
"""
