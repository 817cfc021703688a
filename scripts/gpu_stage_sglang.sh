#!/usr/bin/env bash
# Issue 32: SGLang 0.5.17 for the lent GPU host (Python 3.12, torch 2.11.0+cu130, no network), beside
# the vLLM bundle (../shared/gpu/build-vllm-bundle.sh, which brings flashinfer, xgrammar, openai,
# fastapi, pyzmq, msgspec, ...). Downloads what SGLang's offline Engine and HTTP server need on top of
# it and of the host's image, drops sglang-kernel's FA3 library (flash_ops: 1.1 GB unpacked; the engine
# then runs attention_backend="triton"; FA3=1 stages it apart, OUT/fa3/fN/fa3.part.*, 4 parts of 45 MB, for
# the fa3 cases: copied to DIR/fa3/fN on the host) and its Blackwell (sm100) kernels, and writes
#   OUT/s1/part.00, OUT/s2/part.01, ...  one xz tarball in <= 45 MB parts (one `run` carry each)
#   OUT/x/*.whl   installed on the host only where it lacks them: IPython (+ deps; `import sglang`
#                 needs it), soundfile + cffi and python-multipart (SGLang's HTTP server, verl's path)
#   OUT/tf/*.whl  transformers 5.12.1 + tokenizers 0.22.2 as SGLang pins them: the host's 5.17 fails
#                 `import sglang.srt` ("'qwen3_asr' is already used by a Transformers config")
# Seen 2026-11-25: s1 44 MB, x 10 MB, tf 14 MB. On the host (parts copied to /root/sgl/{s1,x,tf}):
#   bash scripts/gpu_install_sglang.sh /root/sgl  -> /tmp/site_sgl, /tmp/site_sgl_tf (both first on
#   PYTHONPATH for SGLang processes: scripts/gpu_tests.sh sets it).
# EXTRA="pkg==ver ..." adds wheels to the tarball (what scripts/gpu_sglang_probe.py reports missing).
set -euo pipefail
OUT=${1:?usage: gpu_stage_sglang.sh OUT}
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_34_x86_64
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $PLAT -d "$W/whl" \
  sglang==0.5.17 sglang-kernel==0.4.5 torch_memory_saver==0.0.10 blobfile==3.0.0 easydict uvloop xxhash \
  orjson tiktoken pycryptodomex lxml zstandard ${EXTRA:-}
mkdir -p "$W/site"
for w in "$W"/whl/*.whl; do python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$W/site"; done
if [ "${FA3:-0}" = 1 ]; then  # the FA3 library in parts of its own (OUT/fa3/fN: 4 carries), for attention_backend="fa3"
  xz -T0 -6 -c "$W/site/sgl_kernel/flash_ops.abi3.so" > "$W/fa3.xz"
  (cd "$W" && split -b 45m -d fa3.xz fa3.part. && md5sum fa3.xz | cut -d' ' -f1 > fa3.md5)
fi
rm -rf "$W/site/sgl_kernel/flash_ops.abi3.so" "$W/site/sgl_kernel/sm100"
tar -C "$W/site" -cf - . | xz -T0 -6 > "$W/sgl.tar.xz"
rm -rf "$OUT"; mkdir -p "$OUT"
(cd "$W" && split -b 45m -d sgl.tar.xz part. && md5sum sgl.tar.xz | cut -d' ' -f1 > md5)
i=1; for p in "$W"/part.*; do mkdir -p "$OUT/s$i"; mv "$p" "$OUT/s$i/"; i=$((i+1)); done
mv "$W/md5" "$OUT/s1/sgl.md5"
if [ "${FA3:-0}" = 1 ]; then
  i=1; for p in "$W"/fa3.part.*; do mkdir -p "$OUT/fa3/f$i"; mv "$p" "$OUT/fa3/f$i/"; i=$((i+1)); done
  mv "$W/fa3.md5" "$OUT/fa3/f1/"
fi
mkdir -p "$OUT/x" "$OUT/tf"
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $PLAT -d "$OUT/x" ipython decorator ipython-pygments-lexers jedi parso \
  matplotlib-inline pexpect ptyprocess prompt_toolkit wcwidth pygments stack_data executing asttokens pure_eval \
  traitlets nvidia-ml-py soundfile==0.13.1 cffi pycparser python-multipart
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps $PLAT -d "$OUT/tf" transformers==5.12.1 tokenizers==0.22.2
du -sh "$OUT"/*
