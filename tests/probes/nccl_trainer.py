"""The trainer's side of vLLM's NCCL weight-transfer engine, for the probes on a two-GPU machine: the engine
on GPU 0 (rank 1 of the group), this process on GPU 1 (rank 0), as a disaggregated trainer. NCCL refuses
two ranks on one GPU: nothing here runs on a one-GPU machine."""

import socket

TRAINER_GPU = 1


def init_info() -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}


def trainer_group(info: dict):
    """Joins the group (blocks until the engine joins too: call it beside `init_weight_transfer_engine`)."""
    import torch
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    torch.cuda.set_device(TRAINER_GPU)
    return NCCLWeightTransferEngine.trainer_init(info)


def update_info(tensors, packed: bool) -> dict:
    return {"names": [n for n, _ in tensors], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors], "packed": packed}


def send(group, tensors, packed: bool) -> None:
    """Broadcast the tensors (on the trainer's GPU; blocks until the engine received them: call it beside
    `update_weights`)."""
    import torch
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    torch.cuda.set_device(TRAINER_GPU)
    NCCLWeightTransferEngine.trainer_send_weights(iter(tensors), {"group": group, "packed": packed})
    torch.cuda.synchronize()
