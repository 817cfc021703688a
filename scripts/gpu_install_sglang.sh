#!/usr/bin/env bash
# On the GPU host, after the vLLM bundle (and scripts/gpu_env.sh): unpack scripts/gpu_stage_sglang.sh's
# parts (DIR/sN/part.*) into /tmp/site_sgl, add the wheels under DIR/x whose distribution the host lacks
# (what the probe reported missing: IPython, which `import sglang` needs; soundfile + cffi and
# python-multipart, which SGLang's HTTP server needs), put the wheels under DIR/tf (transformers 5.12.1 and
# tokenizers 0.22.2 as SGLang pins them: the host's 5.17 fails `import sglang.srt` on a duplicate config
# name) in /tmp/site_sgl_tf (first on PYTHONPATH), and check that SGLang's engine imports.
set -euo pipefail
DIR=${1:?usage: gpu_install_sglang.sh DIR}
if [ ! -d /tmp/site_sgl/sglang ]; then
  cat "$DIR"/s*/part.* > /tmp/sgl.tar.xz
  [ "$(md5sum /tmp/sgl.tar.xz | cut -d' ' -f1)" = "$(cat "$DIR"/s1/sgl.md5)" ] || { echo "sgl bundle: md5 mismatch"; exit 1; }
  mkdir -p /tmp/site_sgl && tar -C /tmp/site_sgl -xJf /tmp/sgl.tar.xz && rm /tmp/sgl.tar.xz
fi
if ls "$DIR"/fa3/f*/fa3.part.* >/dev/null 2>&1 && [ ! -f /tmp/site_sgl/sgl_kernel/flash_ops.abi3.so ]; then
  cat "$DIR"/fa3/f*/fa3.part.* > /tmp/fa3.xz  # FA3=1 staging: SGLang's fa3 attention backend
  [ "$(md5sum /tmp/fa3.xz | cut -d' ' -f1)" = "$(cat "$DIR"/fa3/f1/fa3.md5)" ] || { echo "fa3: md5 mismatch"; exit 1; }
  xz -dc /tmp/fa3.xz > /tmp/site_sgl/sgl_kernel/flash_ops.abi3.so && rm /tmp/fa3.xz
fi
if ls "$DIR"/x/*.whl >/dev/null 2>&1; then
  need=$(PYTHONPATH=/tmp/site_sgl:/tmp/site python3 - "$DIR"/x/*.whl <<'PY'
import importlib.metadata as md, os, sys
for w in sys.argv[1:]:
    name = os.path.basename(w).split("-")[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(w)
PY
)
  [ -n "$need" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_sgl $need
  echo "extra wheels installed: $(echo $need | wc -w)"
fi
if ls "$DIR"/tf/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_sgl_tf "$DIR"/tf/*.whl
fi
if ls "$DIR"/jit/jit.xz.* >/dev/null 2>&1; then  # kernels SGLang JIT-built on an earlier lease (scripts/gpu_save_jit.sh)
  mkdir -p ~/.cache/tvm-ffi && cat "$DIR"/jit/jit.xz.* | xz -dc | tar -C ~/.cache/tvm-ffi -xf -
  echo "JIT kernels restored: $(find ~/.cache/tvm-ffi -name '*.so' | wc -l)"
fi
PYTHONPATH=/tmp/site_sgl_tf:/tmp/site_sgl:/tmp/site:$PWD python3 scripts/gpu_sglang_probe.py
