#!/usr/bin/env bash
# The calibrated case of tests/gpu/test_vllm_lifecycle.py (sq-int8, FLASHRL_GPU_SQ=DIR) on the GPU host:
# a `flashrl profile` of the SmoothQuant W8A8 SmolLM2 checkpoint (tests' fixture, made by
# llmcompressor in its own venv: scripts/make_smoothquant_fixture.sh) and that checkpoint's
# config.json (its quantization_config) -- ~1.3 MB, carried instead of the 160 MB checkpoint; the
# GPU host rebuilds the served checkpoint from the default model with the profile.
# Usage: bash scripts/gpu_stage_sq.sh .stage/sq   (then carry .stage/sq, copy to /root/sq, --sq /root/sq)
set -euo pipefail
DEST=${1:?usage: gpu_stage_sq.sh DEST}
cd "$(dirname "$0")/.."
PY=.venv/bin/python
MODEL=$($PY -m flashrl_tools models default | tail -1)
KEY=$(cat scripts/llmcompressor_smoothquant.py scripts/make_smoothquant_fixture.sh | sha256sum | cut -c1-12)
SQ=$($PY -c "from flashrl_tools.config.settings import flashrl_home; print(flashrl_home())")/fixtures/smollm2-sq-w8a8-$KEY
[ -f "$SQ/config.json" ] || bash scripts/make_smoothquant_fixture.sh "$MODEL" "$SQ"
mkdir -p "$DEST"
$PY -m flashrl_tools profile -m "$MODEL" -qm "$SQ" -o "$DEST/p.safetensors" --fn int8 --force >/dev/null
cp "$SQ/config.json" "$DEST/config.json"
ls -la "$DEST"
