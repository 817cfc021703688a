#!/usr/bin/env bash
# Wheels of the trainers' code for the GPU host (no network there; DEVELOPERS.md "GPU (device tool)"):
# verl 0.9.1 and what importing its vLLM worker extension and weight sender needs, beside the vLLM
# bundle (../shared/gpu/build-vllm-bundle.sh). Python 3.12, x86-64, no dependencies resolved (the
# host has torch 2.11, transformers, numpy, ...; the vLLM bundle brings pyzmq and loguru).
#   bash scripts/gpu_stage_trainers.sh .stage/t1        # DEST must be git-ignored (/.stage/ is)
# On the host: python3 -m pip install -q --no-index --no-deps --target /tmp/site DEST/*.whl
set -euo pipefail
DEST=${1:?usage: gpu_stage_trainers.sh DEST}
mkdir -p "$DEST"
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
python3 -m pip download -q --no-deps $PLAT -d "$DEST" \
  verl==0.9.1 tensordict==0.10.0 omegaconf==2.3.0 hydra-core==1.3.8 codetiming==1.4.0 pyvers==0.1.0 \
  orjson==3.13.0 importlib_metadata zipp uvicorn accelerate
# the trainers themselves (issue 30: verl's GRPO trainer, TRL's GRPOTrainer; not run on the GPU yet,
# so this list is what they import on the CPU machine minus what the GPU image has)
python3 -m pip download -q --no-deps $PLAT -d "$DEST" \
  datasets multiprocess dill torchdata pylatexenc trl==1.16.0
# verl 0.9.1's trainer (trainer.use_v1, its default) imports TransferQueue
# and vLLM's OpenAI server (verl's rollout server) imports model-hosting-container-standards (not in the bundle)
python3 -m pip download -q --no-deps $PLAT -d "$(dirname "$DEST")/t2" TransferQueue==0.1.11 \
  model-hosting-container-standards==0.1.16 jmespath supervisor
# antlr4 4.9.3 (omegaconf's pin) is published as an sdist only: build its pure-Python wheel here
python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w "$DEST"
ls -la "$DEST"
# Ray (verl imports it at `import verl`): one 72 MB wheel, too large for one call with the bundle;
# split into two carries (DEST/../r1, DEST/../r2) that scripts/gpu_install.sh joins on the host.
R1=$(dirname "$DEST")/r1 R2=$(dirname "$DEST")/r2
mkdir -p "$R1" "$R2"
python3 -m pip download -q --no-deps $PLAT -d "$R1" ray==2.52.1
(cd "$R1" && name=$(ls ray-*.whl) && echo "$name" > NAME && split -b 37m -d "$name" ray.part. && rm "$name" \
  && mv ray.part.01 "../$(basename "$R2")/")
ls -la "$R1" "$R2"
