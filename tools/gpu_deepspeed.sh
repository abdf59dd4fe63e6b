#!/bin/bash
# DeepSpeed's ZeRO-3 on one GPU (world size 1, parallel.dp=1: the engine runs over a group of one), without and with
# ZeRO++'s quantised weights and gradients (parallel.param_comm=int8 and grad_comm=int8: zero_quantized_weights and
# zero_quantized_gradients; hpZ needs more than one rank), and with parameters offloaded to the host; beside them our
# fsdp-free one-process baseline (bucketed at dp=1 is plain AdamW). Prints each run's median step time, its `memory`
# record (device state, host_bytes) and the CUDA peak. About 3 minutes on one H100/H200 with deepspeed installed
# (sdist: pip install 'deepspeed==0.19.8' hjson ninja msgpack py-cpuinfo; it builds its ops on first use).
# Run from the repository root with OUT=<folder>; PY picks the interpreter (default: python3).
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp}
$PY -c "import torch, deepspeed; print(torch.__version__, deepspeed.__version__, torch.cuda.get_device_name())" || exit 1
W="model.preset=gpt2 data.source=synthetic data.vocab_size=50257 data.seq_len=1024 train.batch_size=8 \
train.precision=bf16 train.max_steps=20 train.eval_every=0 train.checkpoint_every=0 train.compile=false \
log.progress=none log.runs_dir=$OUT/runs"
DS="parallel.dp_sync=deepspeed parallel.zero_stage=3"
run() {  # name, overrides...
    local name=$1; shift
    timeout 240 $PY -m gptpar train $W log.run_id=$name "$@" > $OUT/$name.log 2>&1 || tail -5 $OUT/$name.log
}
run plain
run ds3 $DS
run ds3-zeropp $DS parallel.param_comm=int8 parallel.grad_comm=int8
run ds3-offload $DS parallel.offload=params
$PY - <<'PYEOF'
import os, statistics
from pathlib import Path
from gptpar.run.logfile import read_rank_log
out = Path(os.environ.get("OUT", "/tmp"))
print(f"{'run':<12}{'step ms':>9}{'state MB':>10}{'host MB':>9}{'CUDA peak MB':>14}  comm bytes per step")
for run in ("plain", "ds3", "ds3-zeropp", "ds3-offload"):
    try:
        log = read_rank_log(out / "runs" / run / "rank0.jsonl")
    except Exception as exc:  # a run that failed: its log's tail was printed above
        print(f"{run:<12}FAILED ({exc})")
        continue
    steps = sorted(log.steps)[5:]  # warm-up dropped
    step_ms = 1e3 * statistics.median(log.steps[s]["step_time_s"] for s in steps)
    mem = log.memory
    state = sum(mem[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")) / 2**20
    peak = max(log.steps[s].get("peak_mem_bytes") or 0 for s in steps) / 2**20
    print(f"{run:<12}{step_ms:>9.1f}{state:>10.1f}{mem.get('host_bytes', 0) / 2**20:>9.1f}{peak:>14.1f}  "
          f"{log.steps[steps[-1]].get('comm_bytes', {})}")
PYEOF
