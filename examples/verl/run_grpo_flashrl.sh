#!/usr/bin/env bash
# verl GRPO with 8-bit vLLM rollouts through flashrl_tools (verl >= 0.9, vLLM 0.26 - 0.33).
# Nothing in verl changes: the flashrl plugin activates in every vLLM process of the run from
# FLASHRL_CONFIG, which reaches the Ray actors through runtime_env (and the launching shell).
#
#   bash examples/verl/run_grpo_flashrl.sh                # int8, Qwen2.5-7B-Instruct, GSM8K
#   FLASHRL_CONFIG=configs/my-model.yaml MODEL=... bash examples/verl/run_grpo_flashrl.sh
#
# Data: verl's own preprocessing, `python3 -m verl.examples.data_preprocess.gsm8k` (or
# examples/data_preprocess/gsm8k.py in a verl checkout) writes ~/data/gsm8k/{train,test}.parquet.
set -euo pipefail
export FLASHRL_CONFIG=${FLASHRL_CONFIG:-int8}   # int8 | bf16 | a YAML from `flashrl setup` (see README)
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
DATA=${DATA:-$HOME/data/gsm8k}
GPUS=${GPUS:-8}

python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=1024 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=64 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001 \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.calculate_log_probs=True \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
  algorithm.rollout_correction.rollout_is=token \
  algorithm.rollout_correction.rollout_is_threshold=2.0 \
  +ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG="$FLASHRL_CONFIG" \
  trainer.logger='["console"]' trainer.project_name=flashrl trainer.experiment_name="grpo-$FLASHRL_CONFIG" \
  trainer.n_gpus_per_node="$GPUS" trainer.nnodes=1 trainer.total_epochs=1 "$@"
