#!/usr/bin/env bash
# Train the example GPT with ZeRO-1 bf16 on all local GPUs with Dion3, DeepSpeed's Muon and AdamW;
# write one JSON summary per optimizer to $RESULTS (default: runs/deepspeed).
# usage: examples/deepspeed/compare_on_gpus.sh [extra train_gpt.py args, e.g. --steps 60]
set -uo pipefail
RESULTS=${RESULTS:-runs/deepspeed}
GPUS=${GPUS:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
if ! [ "$GPUS" -ge 1 ] 2>/dev/null; then
  echo "compare_on_gpus.sh: needs CUDA GPUs (found GPUS=$GPUS); on CPU, run train_gpt.py --cpu over gloo as examples/deepspeed/README.md shows" >&2
  exit 2
fi
mkdir -p "$RESULTS"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}   # DeepSpeed's op builder chokes on "9.0a"
here=$(dirname "$0")
failed=()
for opt in dion3 muon adamw; do
  timeout ${PER_RUN_TIMEOUT:-300} python3 -m torch.distributed.run --standalone --nproc_per_node "$GPUS" \
    "$here/train_gpt.py" --config "$here/ds_config_$opt.json" --json "$RESULTS/$opt.json" "$@" \
    2>&1 | grep -v "WARNING\|INFO\|UserWarning\|warnings.warn" | tee "$RESULTS/$opt.log" | tail -n 12
  status=${PIPESTATUS[0]}
  [ "$status" = 0 ] || failed+=("$opt (exit $status; $RESULTS/$opt.log)")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "compare_on_gpus.sh: ${#failed[@]} run(s) failed: ${failed[*]}" >&2
  exit 1
fi
