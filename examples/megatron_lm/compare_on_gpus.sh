#!/usr/bin/env bash
# Megatron-LM's pretrain path, bf16, --use-distributed-optimizer: Dion3, Megatron's Muon and Adam on the
# same model, data and steps, then one table (summarize.py): Megatron's `optimizer` timer, the loss.
# usage: [GPUS=1] [TP=1] [SIZE=350m] [ITERS=300] [OPTS="dion3 muon adam"] [RESUME=0 [RESUME_TP=TP]]
#        [SCRIPT=path/to/Megatron-LM/pretrain_gpt.py] examples/megatron_lm/compare_on_gpus.sh [extra flags]
# GPUS: processes (one per GPU), TP: tensor-parallel size (data-parallel size GPUS / TP);
# SIZE: 202m (12 x 1024), 350m (24 x 1024) or 1.3b (24 x 2048), GQA and SwiGLU, vocabulary 32768;
# SCRIPT: Megatron-LM's own pretrain_gpt.py (its --mock-data), default examples/megatron_lm_pretrain_gpt.py
# (the same calls, a synthetic language); RESUME=1 also saves each run at ITERS / 2 (torch_dist) and
# resumes it from there ($RESULTS/<opt>_resumed.log; the summary says whether the losses match);
# RESUME_TP: the resumed run's tensor-parallel size, on the same GPUs and global batch (e.g. GPUS=2 TP=1
# RESUME_TP=2: a DP=2 checkpoint loaded at TP=2; both runs then save with --dist-ckpt-optim-fully-reshardable).
# Extra flags go to every run (e.g. --dion3-fraction 0.125, --seq-length 2048); logs go to $RESULTS
# (default runs/megatron_lm); PER_RUN_TIMEOUT (s, default 1800) bounds each run.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
RESULTS=${RESULTS:-runs/megatron_lm}
GPUS=${GPUS:-1}
TP=${TP:-1}
ITERS=${ITERS:-300}
SCRIPT=${SCRIPT:-$root/examples/megatron_lm_pretrain_gpt.py}
mkdir -p "$RESULTS"
case ${SIZE:-350m} in
  202m) MODEL="--num-layers 12 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16" ;;
  350m) MODEL="--num-layers 24 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16" ;;
  1.3b) MODEL="--num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16" ;;
  *) echo "SIZE must be 202m, 350m or 1.3b, got ${SIZE}" >&2; exit 2 ;;
esac
RESUME_TP=${RESUME_TP:-$TP}
for tp in "$TP" "$RESUME_TP"; do
  [ "$tp" -ge 1 ] 2>/dev/null && [ $((GPUS % tp)) = 0 ] || {
    echo "TP and RESUME_TP must divide GPUS ($GPUS), got TP=$TP RESUME_TP=$RESUME_TP" >&2; exit 2; }
done
DP=$((GPUS / TP))
RESHARD=""
if [ "$RESUME_TP" != "$TP" ]; then
  [ "${RESUME:-0}" = 1 ] || { echo "RESUME_TP=$RESUME_TP needs RESUME=1" >&2; exit 2; }
  # the global batch (8 x DP) stays: the resumed run's data-parallel size must divide it in micro-batches of 8
  [ $((DP % (GPUS / RESUME_TP))) = 0 ] || {
    echo "RESUME_TP=$RESUME_TP: its data-parallel size $((GPUS / RESUME_TP)) does not divide the saved run's $DP" >&2
    exit 2; }
  RESHARD="--dist-ckpt-optim-fully-reshardable"  # Megatron's Adam part reshards only from this format
fi
COMMON="$MODEL --group-query-attention --num-query-groups 4 --swiglu --disable-bias-linear --normalization RMSNorm
  --position-embedding-type rope --untie-embeddings-and-output-weights --seq-length 1024 --max-position-embeddings 1024
  --micro-batch-size 8 --global-batch-size $((8 * DP)) --train-iters $ITERS --lr-decay-style cosine
  --lr-warmup-iters $((ITERS / 10)) --clip-grad 1.0 --weight-decay 0.01 --adam-beta2 0.95 --bf16
  --use-distributed-optimizer --transformer-impl local
  --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-swiglu-fusion --no-rope-fusion
  --no-persist-layer-norm --eval-iters 0 --eval-interval 100000 --log-interval 10 --timing-log-level 1
  --logging-level 20 --tokenizer-type NullTokenizer --vocab-size 32768"
[ "$(basename "$SCRIPT")" = pretrain_gpt.py ] && COMMON="$COMMON --mock-data"
# Each optimizer's flags (override with DION3_FLAGS, MUON_FLAGS, ADAM_FLAGS): the lrs of the one-GPU
# runs in docs/performance.md; the embeddings and output layer take Adam at --decoupled-lr.
declare -A FLAGS=(
  [dion3]="${DION3_FLAGS:---optimizer dion3 --lr 0.01 --min-lr 0.001 --decoupled-lr 0.002 --decoupled-min-lr 0.0002}"
  [muon]="${MUON_FLAGS:---optimizer muon --muon-scale-mode unit_rms_norm --lr 0.01 --min-lr 0.001 --decoupled-lr 0.002 --decoupled-min-lr 0.0002}"
  [adam]="${ADAM_FLAGS:---optimizer adam --lr 0.002 --min-lr 0.0002}")
failed=()  # the logs of the runs that exited with an error
launch() {  # launch LOG TP FLAGS...: one run through the launcher (it registers Dion3; torchrun for > 1 GPU)
  local log=$1 tp=$2; shift 2
  timeout "${PER_RUN_TIMEOUT:-1800}" python3 -m torch.distributed.run --standalone --nproc-per-node "$GPUS" \
    -m dion3_megatron.megatron.launch "$SCRIPT" $COMMON --tensor-model-parallel-size "$tp" "$@" > "$log" 2>&1
  local status=$?
  [ "$status" = 0 ] || failed+=("$log (exit $status)")
  grep -h "Error\|error:" "$log" | tail -n 3
}
OPTS=${OPTS:-dion3 muon adam}
for opt in $OPTS; do
  [ -n "${FLAGS[$opt]:-}" ] || { echo "OPTS: unknown optimizer $opt (dion3, muon, adam)" >&2; exit 2; }
done
for opt in $OPTS; do
  if [ "${RESUME:-0}" = 1 ]; then
    ckpt="$RESULTS/ckpt_$opt"
    rm -rf "$ckpt" "$ckpt.resumed"
    launch "$RESULTS/$opt.log" "$TP" ${FLAGS[$opt]} --save "$ckpt" --save-interval $((ITERS / 2)) \
      --ckpt-format torch_dist $RESHARD "$@"
    launch "$RESULTS/${opt}_resumed.log" "$RESUME_TP" ${FLAGS[$opt]} --load "$ckpt" --ckpt-step $((ITERS / 2)) \
      --save "$ckpt.resumed" --save-interval $((ITERS / 2)) --ckpt-format torch_dist $RESHARD "$@"
  else
    launch "$RESULTS/$opt.log" "$TP" ${FLAGS[$opt]} "$@"
  fi
done
python3 "$here/summarize.py" "$RESULTS"/*.log
summarized=$?
if [ ${#failed[@]} -gt 0 ]; then
  echo "compare_on_gpus.sh: ${#failed[@]} run(s) failed: ${failed[*]}" >&2
  exit 1
fi
exit $summarized
