#!/usr/bin/env bash
# On the GPU host, after the vLLM bundle (and scripts/gpu_env.sh): unpack scripts/gpu_stage_sglang.sh's
# parts (DIR/sN/part.*) into /tmp/site_sgl and check that SGLang's engine imports.
set -euo pipefail
DIR=${1:?usage: gpu_install_sglang.sh DIR}
cat "$DIR"/s*/part.* > /tmp/sgl.tar.xz
[ "$(md5sum /tmp/sgl.tar.xz | cut -d' ' -f1)" = "$(cat "$DIR"/s1/sgl.md5)" ] || { echo "sgl bundle: md5 mismatch"; exit 1; }
mkdir -p /tmp/site_sgl && tar -C /tmp/site_sgl -xJf /tmp/sgl.tar.xz && rm /tmp/sgl.tar.xz
PYTHONPATH=/tmp/site_sgl:/tmp/site:$PWD python3 scripts/gpu_sglang_probe.py
