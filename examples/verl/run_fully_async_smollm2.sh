#!/usr/bin/env bash
# verl 0.9.1's fully-async trainer (verl/experimental/fully_async_policy) with 8-bit vLLM rollouts on TWO GPUs:
# the rollouter's vLLM replica on one, the FSDP trainer on the other; the trainer pushes new weights through
# verl's NCCL checkpoint engine while the rollouter's requests are in flight (verl aborts them with
# `pause_generation(mode="abort")`, syncs, resumes, and continues each partial rollout: prompt + its tokens).
# The embedded SmolLM2-135M-Instruct learns examples/arith_task.py; nothing in verl changes: FLASHRL_CONFIG
# (and FLASHRL_KV_CACHE_DTYPE) reach every vLLM process through Ray's runtime_env.
#
#   FLASHRL_CONFIG=int8 STEPS=20 bash examples/verl/run_fully_async_smollm2.sh
#   FLASHRL_CONFIG=fp8 FLASHRL_KV_CACHE_DTYPE=fp8 bash examples/verl/run_fully_async_smollm2.sh
#   ROLLOUT_MAX_SEQS=4 MAX_RESPONSE_LEN=256 STALENESS=2 ...
#       partial rollouts: verl aborts the requests in flight at a sync and resumes each as prompt + its tokens,
#       but only a rollouter slower than the trainer has requests in flight then (a faster one waits at its
#       staleness bound: 2026-11-26, 24 steps at vLLM's 256 sequences, 0 partial). vLLM decoding 4 sequences at
#       a time makes this 135M rollouter the slower side.
#   -> runs/verl-async/async-int8-s0.jsonl (verl's file logger)
#
# Extra arguments are verl (hydra) overrides. VERL_MAIN replaces `python3 -m
# verl.experimental.fully_async_policy.fully_async_main` (tests/test_verl_recipe.py composes the config with it
# on a machine without a GPU). FINAL_CHECK=1 keeps the rollout engine's weight digest after every sync
# (FLASHRL_SYNC_DIGEST=OUT/digest-RUN) and the trainer's last weights (OUT/ckpt-RUN) for
# examples/verl/final_check.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
export FLASHRL_CONFIG=${FLASHRL_CONFIG:?set FLASHRL_CONFIG: bf16, int8, fp8 or a config YAML}
SEED=${SEED:-0}
STEPS=${STEPS:-20}          # trainer steps (each a mini-batch of BATCH prompts x 4 responses)
BATCH=${BATCH:-16}
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-32}
STALENESS=${STALENESS:-0.5}  # how far the rollouter may run ahead of the trainer (verl: staleness_threshold)
ROLLOUT_MAX_SEQS=${ROLLOUT_MAX_SEQS:-256}  # sequences vLLM decodes at once (verl's default 256)
OUT=$(realpath -m "${OUT:-runs/verl-async}")   # absolute: verl's driver and workers are Ray actors
MODEL=${MODEL:-$(python3 -m flashrl_tools models default)}
DATA=$OUT/data
[ -f "$DATA/train.parquet" ] || python3 examples/verl/arith_data.py "$DATA" --train $((STEPS * BATCH * 2)) --seed 0 >/dev/null
TAG=$(basename "$FLASHRL_CONFIG" .yaml)${FLASHRL_KV_CACHE_DTYPE:+-kv$FLASHRL_KV_CACHE_DTYPE}
RUN=${RUN:-async-$TAG-s$SEED}
export VERL_FILE_LOGGER_PATH=${VERL_FILE_LOGGER_PATH:-$OUT/$RUN.jsonl}
ENV=(+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG="$FLASHRL_CONFIG")
[ -n "${FLASHRL_KV_CACHE_DTYPE:-}" ] && ENV+=(+ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_KV_CACHE_DTYPE="$FLASHRL_KV_CACHE_DTYPE")
CHECK=()
if [ "${FINAL_CHECK:-0}" = 1 ]; then
  CHECK=(trainer.save_freq="$STEPS" "actor_rollout_ref.actor.checkpoint.save_contents=['hf_model']"
         trainer.max_actor_ckpt_to_keep=1 trainer.default_local_dir="$OUT/ckpt-$RUN"
         +ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_SYNC_DIGEST="$OUT/digest-$RUN")
fi
MAIN=${VERL_MAIN:-python3 -m verl.experimental.fully_async_policy.fully_async_main}
$MAIN \
  algorithm.adv_estimator=grpo \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  data.train_batch_size=0 data.gen_batch_size=1 data.max_prompt_length=64 data.max_response_length="$MAX_RESPONSE_LEN" \
  data.seed="$SEED" \
  actor_rollout_ref.model.path="$MODEL" \
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa actor_rollout_ref.model.use_remove_padding=False \
  actor_rollout_ref.actor.optim.lr=1e-5 \
  actor_rollout_ref.actor.ppo_mini_batch_size="$BATCH" \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.data_loader_seed="$SEED" \
  actor_rollout_ref.hybrid_engine=False \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.mode=async \
  actor_rollout_ref.rollout.n=4 actor_rollout_ref.rollout.max_num_seqs="$ROLLOUT_MAX_SEQS" \
  actor_rollout_ref.rollout.seed="$SEED" \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
  actor_rollout_ref.rollout.checkpoint_engine.backend=nccl \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64 \
  algorithm.rollout_correction.rollout_is=token \
  algorithm.rollout_correction.rollout_is_threshold=2.0 \
  async_training.staleness_threshold="$STALENESS" async_training.trigger_parameter_sync_step=1 \
  async_training.require_batches=1 async_training.partial_rollout=True \
  rollout.nnodes=1 rollout.n_gpus_per_node=1 rollout.total_rollout_steps=$((STEPS * BATCH * 2)) \
  reward.custom_reward_function.path="$PWD/examples/verl/arith_reward.py" reward.custom_reward_function.name=compute_score \
  "${ENV[@]}" \
  trainer.logger='["console","file"]' trainer.project_name=flashrl trainer.experiment_name="$RUN" \
  trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_epochs=1 trainer.total_training_steps="$STEPS" \
  trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=-1 "${CHECK[@]}" "$@"
