#!/usr/bin/env bash
# On the GPU host, after the staging calls (DEVELOPERS.md "GPU (device tool)"): the vLLM bundle's parts
# under /root/stage/c*, optionally the trainers' wheels (scripts/gpu_stage_trainers.sh) in .stage/t1 and
# Ray's wheel in parts under /root/ray. Installs everything into /tmp/site.
set -euo pipefail
bash /root/stage/c1/install-vllm-bundle.sh /root/stage
if ls .stage/t1/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .stage/t1/*.whl
fi
if ls /root/ray/ray.part.* >/dev/null 2>&1; then
  whl=/root/ray/$(cat /root/ray/NAME)
  cat /root/ray/ray.part.* > "$whl"
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "$whl" 2>&1 | grep -v "already exists" || true
fi
PYTHONPATH=/tmp/site python3 -c "import vllm; print('vllm', vllm.__version__)"
PYTHONPATH=/tmp/site python3 -c "import verl, ray; print('verl', verl.__version__, 'ray', ray.__version__)" 2>/dev/null || true
