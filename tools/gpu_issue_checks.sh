#!/bin/bash
# The GPU checks issues 49 and 50 ask for, in one short run on a lent GPU (docs/gpu.md): a real GPU trace read by
# `gptpar trace` (Holistic Trace Analysis beside gptpar's own), vit-base steps with LoRA and without (their MFU and
# peak memory through `gptpar report`), then DeepSpeed ZeRO-3 with and without ZeRO++ (tools/gpu_deepspeed.sh).
# Run from the repository root with OUT=<folder>; PY picks the interpreter (default: python3). About 6 minutes.
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp}
export PYTHONUNBUFFERED=1 OUT
RUNS=$OUT/runs
$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
echo "== a GPU trace and gptpar trace"
timeout 120 $PY -m gptpar train model.preset=gpt2-tiny data.source=synthetic train.max_steps=6 train.profile_steps=3-5 \
    train.compile=false train.eval_every=0 log.progress=none log.runs_dir=$RUNS log.run_id=gputrace 2>&1 | tail -3
timeout 120 $PY -m gptpar trace $RUNS/gputrace 2>&1 | tail -30
echo "== vit-base on the embedded images: LoRA r=8 with checkpointing, and full training (bf16)"
V="model.preset=vit-base data.task=classify data.source=synthetic data.synthetic_images=4096 train.batch_size=64 \
train.precision=bf16 train.compile=false train.max_steps=40 train.eval_every=0 train.eval_batches=2 train.lr=1e-3 \
log.progress=none log.runs_dir=$RUNS"
timeout 150 $PY -m gptpar train $V log.run_id=vit-base-lora train.lora_rank=8 train.activation_checkpointing=block \
    2>&1 | tail -2
timeout 150 $PY -m gptpar train $V log.run_id=vit-base-full 2>&1 | tail -2
timeout 60 $PY -m gptpar report $RUNS --out $OUT/report > /dev/null 2>&1
grep -E "^\| (run|vit|gputrace)|MFU" $OUT/report/summary.md | head -12
echo "== DeepSpeed ZeRO-3 with and without ZeRO++ against one process"
timeout ${DS_S:-200} bash tools/gpu_deepspeed.sh 2>&1 | tail -12
tar czf $OUT/gpu_runs.tgz -C $OUT runs/gputrace runs/vit-base-lora/rank0.jsonl runs/vit-base-full/rank0.jsonl \
    report/summary.md 2>/dev/null
ls -la $OUT
