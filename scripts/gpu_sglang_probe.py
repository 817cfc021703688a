"""On the GPU host: which modules SGLang's offline engine still lacks (import the modules an Engine
start imports, and report every missing one with the wheel that provides it, one at a time as
imports fail), then every requirement of the sglang distribution that is not installed or not met
(the wheels to consider staging; many are optional kernels). Exit 0 when everything imports."""

import importlib
import importlib.metadata as md
import sys

MODULES = ["sglang", "sglang.srt.entrypoints.engine", "sglang.srt.managers.scheduler",
           "sglang.srt.model_executor.model_runner", "sglang.srt.models.qwen3", "sglang.srt.models.qwen3_moe",
           "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors", "sgl_kernel",
           "torch_memory_saver", "flashrl_tools.runtime.sglang.plugin"]
missing = []
for name in MODULES:
    try:
        importlib.import_module(name)
        print(f"ok      {name}")
    except ModuleNotFoundError as e:
        missing.append(e.name)
        print(f"MISSING {name}: no module {e.name!r}")
    except Exception as e:  # noqa: BLE001 -- report, do not stop: the next import may tell more
        print(f"ERROR   {name}: {type(e).__name__}: {e}")
        missing.append(name)
try:
    from packaging.requirements import Requirement

    for line in md.requires("sglang") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            print(f"UNMET   {req}: not installed")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            print(f"UNMET   {req}: {have} installed")
except Exception as e:  # noqa: BLE001 -- the import report above is what matters
    print(f"(requirements not checked: {type(e).__name__}: {e})")
sys.exit(1 if missing else 0)
