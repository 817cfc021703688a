#!/usr/bin/env bash
# verl 0.9.1's own GRPO trainer on ONE GPU: the embedded SmolLM2-135M-Instruct (real weights) learns
# examples/arith_task.py ("What is a + b?", reward 1 when the answer contains the sum). verl's Ray
# driver, FSDP actor and hybrid-engine vLLM rollout (sleep mode level 2, its default) run unchanged;
# the precision comes from FLASHRL_CONFIG alone; TIS (token, C = 2) from verl's rollout correction.
#
#   FLASHRL_CONFIG=int8 SEED=0 STEPS=100 bash examples/verl/run_grpo_smollm2.sh
#   -> runs/verl/verl-int8-s0.jsonl (verl's file logger: reward, rollout_corr/*, timing_s/*)
#   python benchmarks/rl_curves.py --out docs/rl/verl-smollm2 bf16/0=runs/verl/verl-bf16-s0.jsonl ...
#
# LEVEL picks the task (examples/arith_task.py LEVELS; default add1, the one every config saturates; issue
# 44's runs use a harder one). TIS=token (default: truncated IS, C = 2) | off (no correction; verl still
# logs the mismatch) | mis (token-level masking outside [0.5, 2], verl's IcePop). Every run logs the
# token-level mismatch (flashrl_tools/verl_metrics.py: mean and p99 |d log p|, ratios above 2).
# HELDOUT=1 (with FINAL_CHECK=1) keeps every CHECK_EVERY checkpoint for examples/verl/heldout_eval.py.
#
# FINAL_CHECK=1 keeps what examples/verl/final_check.py compares after the run: the actor's weights
# (verl's hf_model checkpoint, OUT/ckpt-RUN, at the last step and every CHECK_EVERY steps, so a run
# cut short can still be checked), the rollout engine's weight digest after every sync
# (FLASHRL_SYNC_DIGEST=OUT/digest-RUN) and verl's greedy validation after the same syncs (OUT/val-RUN). Extra arguments are verl (hydra) overrides. VERL_MAIN replaces
# `python3 -m verl.trainer.main_ppo` (tests/test_verl_recipe.py composes the config with it on a
# machine without a GPU).
set -euo pipefail
cd "$(dirname "$0")/../.."
export FLASHRL_CONFIG=${FLASHRL_CONFIG:?set FLASHRL_CONFIG: bf16, int8, fp8 or a config YAML}
SEED=${SEED:-0}
STEPS=${STEPS:-100}
BATCH=${BATCH:-32}       # prompts per step (x N=8 completions)
OUT=$(realpath -m "${OUT:-runs/verl}")   # absolute: verl's driver and workers are Ray actors
MODEL=${MODEL:-$(python3 -m flashrl_tools models default)}
LEVEL=${LEVEL:-add1}
DATA=$OUT/data; [ "$LEVEL" = add1 ] || DATA=$OUT/data-$LEVEL
[ -f "$DATA/train.parquet" ] || python3 examples/verl/arith_data.py "$DATA" --train $((STEPS * BATCH)) --seed 0 \
  --level "$LEVEL" >/dev/null
case ${TIS:-token} in
  token) CORR=(algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold=2.0) ;;
  off)   CORR=(algorithm.rollout_correction.rollout_is=null) ;;
  mis)   CORR=(algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_threshold='"0.5_2.0"') ;;
  *) echo "TIS=${TIS}: use token, off or mis" >&2; exit 2 ;;
esac
TAG=$(basename "$FLASHRL_CONFIG" .yaml)
RUN=${RUN:-verl-$TAG-s$SEED}
export VERL_FILE_LOGGER_PATH=${VERL_FILE_LOGGER_PATH:-$OUT/$RUN.jsonl}
CHECK=()
if [ "${FINAL_CHECK:-0}" = 1 ]; then  # every CHECK_EVERY steps and at the last (only the latest kept)
  CHECK=(trainer.save_freq="${CHECK_EVERY:-$STEPS}" "actor_rollout_ref.actor.checkpoint.save_contents=['hf_model']"
         trainer.max_actor_ckpt_to_keep="$([ "${HELDOUT:-0}" = 1 ] && echo null || echo 1)"
         trainer.default_local_dir="$OUT/ckpt-$RUN" trainer.test_freq="${CHECK_EVERY:-$STEPS}"
         trainer.validation_data_dir="$OUT/val-$RUN"
         +ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_SYNC_DIGEST="$OUT/digest-$RUN")
fi
MAIN=${VERL_MAIN:-python3 -m verl.trainer.main_ppo}
$MAIN \
  algorithm.adv_estimator=grpo \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  data.train_batch_size="$BATCH" data.max_prompt_length="${PROMPT_LEN:-64}" data.max_response_length=32 data.seed="$SEED" \
  actor_rollout_ref.model.path="$MODEL" \
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa actor_rollout_ref.model.use_remove_padding=False \
  actor_rollout_ref.actor.optim.lr=1e-5 \
  actor_rollout_ref.actor.ppo_mini_batch_size="$BATCH" \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.data_loader_seed="$SEED" \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.seed="$SEED" \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.3 \
  actor_rollout_ref.rollout.calculate_log_probs=True \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64 \
  "${CORR[@]}" \
  +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=flashrl_tools.verl_metrics.install \
  reward.custom_reward_function.path="$PWD/examples/verl/arith_reward.py" reward.custom_reward_function.name=compute_score \
  +ray_kwargs.ray_init.runtime_env.env_vars.FLASHRL_CONFIG="$FLASHRL_CONFIG" \
  trainer.logger='["console","file"]' trainer.project_name=flashrl trainer.experiment_name="grpo-$TAG-s$SEED" \
  trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_epochs=1 trainer.total_training_steps="$STEPS" \
  trainer.val_before_train=False trainer.test_freq=-1 trainer.save_freq=-1 "${CHECK[@]}" "$@"
