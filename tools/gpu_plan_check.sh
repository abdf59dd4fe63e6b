#!/bin/bash
# The planner's GPU check (about 5 minutes on one H100): `gptpar plan calibrate` on the GPU (the shipped calibration's
# source), then gpt2 trained briefly (eager, bf16; plain and with grad_accum=2 and recomputation) beside its
# prediction. Run from the repository root with OUT=<folder>; PY picks the interpreter (default: python).
set -x
cd "$(dirname "$0")/.."
PY=${PY:-python}
$PY -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
start=$(date +%s)
timeout 200 $PY -m gptpar plan calibrate --out $OUT/h100.json || echo CALIBRATE FAILED
echo "calibrate took $(( $(date +%s) - start )) s"
W="model.preset=gpt2 data.source=synthetic data.vocab_size=50257 data.seq_len=1024 train.batch_size=8 train.eval_every=0 train.compile=false log.progress=none train.checkpoint_every=0"
timeout 150 $PY -m gptpar train $W train.max_steps=25 log.runs_dir=$OUT/runs log.run_id=g1 > $OUT/train1.log 2>&1 || tail -5 $OUT/train1.log
timeout 150 $PY -m gptpar train $W train.grad_accum=2 train.activation_checkpointing=block train.max_steps=25 log.runs_dir=$OUT/runs log.run_id=g2 > $OUT/train2.log 2>&1 || tail -5 $OUT/train2.log
$PY -m gptpar plan predict $W --calibration $OUT/h100.json --json > $OUT/pred1.json; cat $OUT/pred1.json
$PY -m gptpar plan predict $W train.grad_accum=2 train.activation_checkpointing=block --calibration $OUT/h100.json --json > $OUT/pred2.json; cat $OUT/pred2.json
$PY - <<'PYEOF'
import json, os, statistics
from pathlib import Path
from gptpar.run.logfile import read_rank_log
out = Path(os.environ["OUT"])
for run, pred in (("g1", "pred1.json"), ("g2", "pred2.json")):
    try:
        log = read_rank_log(out / "runs" / run / "rank0.jsonl")
        steps = sorted(log.steps)[5:]
        meas = statistics.median(log.steps[s]["step_time_s"] for s in steps)
        p = json.loads((out / pred).read_text())
        mem = log.memory
        print(run, "measured", meas, "predicted", p["step_time_s"], "err", p["step_time_s"] / meas - 1,
              "state meas", sum(mem[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")), "pred", p["memory"]["state"],
              "peak_mem", max(log.steps[s]["peak_mem_bytes"] for s in steps), "pred total", p["memory_bytes"])
    except Exception as exc:
        print(run, "FAILED", exc)
PYEOF
