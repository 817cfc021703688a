"""Tensor-by-tensor access to (sharded) safetensors checkpoints, for reading and writing.

Reading parses each file's header once and then reads one tensor's bytes at a time with plain
file reads (no memory map, whose touched pages would count towards RSS until the file closes).
Writing uses the format's layout directly: the header is planned from shapes and dtypes first,
then each tensor's bytes are appended as soon as it is computed, so peak memory is one tensor,
not one shard.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from flashrl_tools.checkpoint_files import INDEX_NAME, checkpoint_files
from flashrl_tools.errors import FlashRLError

SINGLE_NAME = "model.safetensors"

_DTYPE_CODES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.int32: "I32", torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float32: "F32", torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


class CheckpointReader:
    """All tensors of a safetensors checkpoint directory, by name, read lazily."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        self.files = checkpoint_files(self.dir)
        self._where: dict[str, Path] = {}
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self._span: dict[str, tuple[int, int]] = {}  # absolute byte range in its file
        for f in self.files:
            data_start, header = _read_header(f)
            entries = sorted((k for k in header if k != "__metadata__"),
                             key=lambda k: header[k]["data_offsets"][0])
            for name in entries:
                info = header[name]
                if info["dtype"] not in _CODE_DTYPES:
                    raise FlashRLError(f"unsupported tensor dtype {info['dtype']} for {name}", str(f))
                begin, end = info["data_offsets"]
                self._where[name] = f
                self._meta[name] = (tuple(info["shape"]), _CODE_DTYPES[info["dtype"]])
                self._span[name] = (data_start + begin, data_start + end)

    def names(self) -> list[str]:
        """Every tensor name, in the order `iter_tensors` yields them."""
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta[name][1]

    def file_of(self, name: str) -> Path:
        return self._where[name]

    def get(self, name: str) -> torch.Tensor:
        with open(self._where[name], "rb") as f:
            return self._read(f, name)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor once, file by file in storage order (sequential reads)."""
        for path in self.files:
            with open(path, "rb") as f:
                for name in (n for n, p in self._where.items() if p == path):
                    yield name, self._read(f, name)

    def _read(self, f, name: str) -> torch.Tensor:
        begin, end = self._span[name]
        shape, dtype = self._meta[name]
        buf = bytearray(end - begin)
        f.seek(begin)
        if f.readinto(buf) != len(buf):
            raise FlashRLError(f"file ends inside tensor {name}", str(self._where[name]),
                               "the checkpoint is truncated: download or copy it again")
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def _read_header(path: Path) -> tuple[int, dict]:
    """(offset where the data section starts, parsed JSON header)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise ValueError(f"header length {n} is implausible")
            return 8 + n, json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise FlashRLError(f"not a readable safetensors file ({e})", str(path),
                           "check the file is complete and not a Git LFS pointer") from None


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def write_checkpoint(
    out_dir: Path,
    plan: list[PlannedTensor],
    produce: Callable[[], Iterator[tuple[str, torch.Tensor]]],
    max_shard_bytes: int = 4 << 30,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write tensors (yielded by `produce` in `plan` order) as safetensors shards + index.

    Each tensor is checked against its planned name, shape and dtype, then written and dropped.
    """
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in plan:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    names = [SINGLE_NAME] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    stream = produce()
    paths = []
    for shard_name, shard in zip(names, shards):
        path = Path(out_dir) / shard_name
        _write_shard(path, shard, stream, metadata or {"format": "pt"})
        paths.append(path)
    if next(stream, None) is not None:
        raise RuntimeError("producer yielded more tensors than planned")
    if len(shards) > 1:
        weight_map = {t.name: n for n, shard in zip(names, shards) for t in shard}
        total = sum(t.nbytes for t in plan)
        (Path(out_dir) / INDEX_NAME).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return paths


def _write_shard(path: Path, shard: list[PlannedTensor], stream: Iterator, metadata: dict) -> None:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for t in shard:
        header[t.name] = {"dtype": _DTYPE_CODES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in shard:
            name, tensor = next(stream)
            if name != t.name or tuple(tensor.shape) != t.shape or tensor.dtype != t.dtype:
                raise RuntimeError(
                    f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} does not match the plan "
                    f"{t.name} {t.shape} {t.dtype}")
            f.write(memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
