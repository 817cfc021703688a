#!/usr/bin/env bash
# A SmoothQuant + RTN W8A8 checkpoint of the embedded model, made by llmcompressor in its own
# venv (all three mappings: q/k/v <- input_layernorm, gate/up <- post_attention_layernorm,
# down <- up). Written atomically to OUT_DIR; tests cache it under $FLASHRL_HOME.
# Usage: bash scripts/make_smoothquant_fixture.sh BF16_DIR OUT_DIR
set -euo pipefail
SRC=${1:?usage: make_smoothquant_fixture.sh BF16_DIR OUT_DIR}; OUT=${2:?usage: make_smoothquant_fixture.sh BF16_DIR OUT_DIR}
HERE="$(cd "$(dirname "$0")" && pwd)"
PY=$(bash "$HERE/llmcompressor_venv.sh")
TMP="$OUT.tmp-$$"; rm -rf "$TMP"; trap 'rm -rf "$TMP"' EXIT
"$PY" "$HERE/llmcompressor_smoothquant.py" "$SRC" "$TMP" --down-proj >&2
chmod 644 "$TMP"/*; rm -rf "$OUT"; mv "$TMP" "$OUT"
echo "$OUT"
