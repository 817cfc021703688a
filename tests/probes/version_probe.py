"""One in-process vLLM engine under FLASHRL_CONFIG whose installed version reads as an untested one (issue 72's
start-up self-check), greedy-generating a few tokens.
Usage: python version_probe.py REQUEST.json RESULT.json
REQUEST: {"model": dir, "version": "0.99.0", "policy_source": dir | null (what the self-check pushes back
          instead of the served policy: a sync path that changes the weights)}
RESULT: {"tokens": [ids]} or {"error": the refusal's message}"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from pathlib import Path  # noqa: E402

from flashrl_tools.runtime.core import reload_check  # noqa: E402
from flashrl_tools.runtime.vllm import capabilities  # noqa: E402

req = json.loads(Path(sys.argv[1]).read_text())
capabilities.vllm_version = lambda: req["version"]
if req.get("policy_source"):
    reload_check.policy_source = lambda loaded_dir, rc: Path(req["policy_source"])

from vllm import LLM, SamplingParams  # noqa: E402

try:
    llm = LLM(model=req["model"], max_model_len=256, enforce_eager=True, enable_prefix_caching=False, seed=0)
    out = llm.generate([{"prompt_token_ids": [5, 70, 75, 82]}], SamplingParams(temperature=0.0, max_tokens=4))
    result = {"tokens": list(out[0].outputs[0].token_ids)}
except Exception as e:  # noqa: BLE001 -- the refusal is the result
    result = {"error": str(e)}
Path(sys.argv[2]).write_text(json.dumps(result))
