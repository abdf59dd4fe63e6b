#!/bin/bash
# The GPU check of a session lent a CUDA machine (docs/gpu.md): the tests that run only where CUDA is visible, the
# fast tier on a machine that sees a GPU (no test may assume 0 GPUs), then bench-step's three main rows.
# Run from the repository root with OUT=<folder>; PY picks the interpreter (default: python3).
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
$PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== GPU-only tests"
timeout 240 $PY -m pytest -q -p no:cacheprovider -rs tests/train/test_fast_path.py tests/train/test_compile.py::test_the_compiled_loss_under_inductor_gives_the_plain_loss_and_gradients tests/parallel/pipeline/test_pipeline_gpt2.py 2>&1 | tee $OUT/gpu_tests.log | tail -25
echo "== fast tier with a GPU visible"
timeout 200 $PY -m pytest -q -p no:cacheprovider -m "not slow" --maxfail=40 --timeout 120 2>&1 | tee $OUT/fast_tier.log | tail -25
echo "== bench-step"
timeout ${BENCH_S:-200} $PY bench/bench_step.py --batch 8 --rounds 3 --rows bare,tuned,gptpar --out $OUT/bench_step.json 2>&1 | tail -12
