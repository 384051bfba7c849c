#!/usr/bin/env bash
# Hugging Face Trainer + DeepSpeed, bf16: Dion3, DeepSpeed's Muon and AdamW on the same Llama-style
# model and data; one JSON summary per optimizer in $RESULTS (default: runs/hf_trainer).
# usage: [GPUS=1] [STAGE=1] [OPTS="dion3 muon adamw"] examples/hf_trainer/compare_on_gpus.sh
#        [extra train.py / TrainingArguments flags, e.g. --max_steps 300]
# GPUS: processes (one per GPU); STAGE: the ZeRO stage (0, 1 or 2: Dion3's) written into a copy of
# each ds_config_*.json; OPTS picks the optimizers (one per call keeps each run short).
set -uo pipefail
RESULTS=${RESULTS:-runs/hf_trainer}
GPUS=${GPUS:-1}
STAGE=${STAGE:-1}
OPTS=${OPTS:-dion3 muon adamw}
declare -A LR=([dion3]=0.01 [muon]=0.02 [adamw]=0.002)
case $STAGE in 0|1|2) ;; *) echo "STAGE must be 0, 1 or 2 (the ZeRO stages Dion3 supports), got $STAGE" >&2; exit 2 ;; esac
[ "$GPUS" -ge 1 ] 2>/dev/null || { echo "GPUS must be a number of GPUs, got $GPUS" >&2; exit 2; }
for opt in $OPTS; do
  [ -n "${LR[$opt]:-}" ] || { echo "OPTS: unknown optimizer $opt (dion3, muon, adamw)" >&2; exit 2; }
done
mkdir -p "$RESULTS"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}   # DeepSpeed's op builder chokes on "9.0a"
here=$(dirname "$0")
failed=()
for opt in $OPTS; do
  config="$RESULTS/ds_config_${opt}_zero$STAGE.json"
  python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["zero_optimization"]["stage"] = int(sys.argv[2]);
json.dump(c, open(sys.argv[3], "w"), indent=1)' "$here/ds_config_$opt.json" "$STAGE" "$config" || exit 1
  timeout ${PER_RUN_TIMEOUT:-600} python3 -m torch.distributed.run --standalone --nproc_per_node "$GPUS" "$here/train.py" \
    --deepspeed "$config" --output_dir "$RESULTS/$opt" --json "$RESULTS/$opt.json" \
    --bf16 --learning_rate "${LR[$opt]}" --lr_scheduler_type constant --warmup_steps 0 \
    --per_device_train_batch_size 16 --max_steps 200 --logging_steps 1 --save_strategy no \
    --report_to none --disable_tqdm true --dataloader_num_workers 0 "$@" \
    2>&1 | grep -v "WARNING\|INFO\|UserWarning\|warnings.warn" | tee "$RESULTS/$opt.log" | grep "SUMMARY\|Error" | tail -n 3
  status=${PIPESTATUS[0]}
  [ "$status" = 0 ] || failed+=("$opt (exit $status; $RESULTS/$opt.log)")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "compare_on_gpus.sh: ${#failed[@]} run(s) failed: ${failed[*]}" >&2
  exit 1
fi
