# gptpar: `make install`, `make test`, `make demo`; cluster targets live in jobs/Makefile.launch.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
GPTPAR := $(VENV)/bin/gptpar
# The CPU build on this machine's disk; on a cluster, PyPI's torch wheel for Linux is the CUDA build.
TORCH_SPEC ?= torch==2.13.0
RUNS ?= runs
FIGURES ?= figures
# One stamp per torch spec: `make install TORCH_SPEC=...` after a plain install installs that torch.
STAMP := $(VENV)/.installed-$(shell printf '%s' '$(subst ','\'',$(TORCH_SPEC))' | cksum | cut -d' ' -f1)
# pip says each package as it collects and installs it (a sign of life through minutes of downloads), less its
# warning about every local wheel folder it does not find and what is installed already; its real errors still
# fail the target.
QUIET_PIP := 2>&1 | { grep --line-buffered -Ev "^(WARNING: Location|Requirement already satisfied)" || true; }
# `make demo CLUSTER=slurm` runs the same demo as SLURM jobs on a cluster (e.g. `make cluster-up`).
CLUSTER ?= local
DEMO_RUNS ?= $(RUNS)/demo
DEMO_FIGURES ?= $(FIGURES)/demo

.PHONY: install lock test test-fast lint demo bench bench-dp bench-pp bench-pp-dist bench-fsdp bench-tp bench-precision bench-step bench-analysis bench-moe bench-comm bench-comm-accuracy bench-plan bench-cp figures config-reference log-reference clean

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@echo "creating the virtual environment $(VENV) (where none is)"
	test -x $(PY) || python3 -m venv $(VENV)
	@echo "installing $(TORCH_SPEC) (a CUDA build is GBs: minutes on a slow network)"
	$(PY) -m pip install --disable-pip-version-check $(TORCH_SPEC) $(QUIET_PIP)
	@echo "installing the tested lock (requirements.lock: every extra and the dev tools; minutes)"
	$(PY) -m pip install --disable-pip-version-check -r requirements.lock $(QUIET_PIP)
	@echo "installing Holistic Trace Analysis without its declared dependencies (it pins jupyterlab, unused; the trace extra holds what it imports)"
	$(PY) -m pip install --disable-pip-version-check --no-deps holistictraceanalysis==0.5.0 $(QUIET_PIP)
	@echo "installing gptpar itself (editable: the checkout is the package)"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e . $(QUIET_PIP)
	@echo "checking that every package imports (up to a minute on a busy login node)"
	$(PY) -c "import torch, transformers, datasets, sacrebleu, tensorboard, wandb, submitit, peft, deepspeed, hta, pytest, gptpar, analysis"
	rm -f $(VENV)/.installed*
	touch $(STAMP)
	@echo "installed; check this node with: $(GPTPAR) doctor"

# After upgrading packages in .venv and passing `make test`: record the tested set.
lock:
	$(PY) tools/lock.py > requirements.lock

demo: install
	$(GPTPAR) sweep sweeps/demo_dp.yaml launch.cluster=$(CLUSTER) --runs-dir $(DEMO_RUNS) --wait
	$(GPTPAR) sweep sweeps/demo_pp.yaml launch.cluster=$(CLUSTER) --runs-dir $(DEMO_RUNS) --wait
	$(GPTPAR) sweep sweeps/demo_pp_engine.yaml launch.cluster=$(CLUSTER) --runs-dir $(DEMO_RUNS) --wait
	$(GPTPAR) report $(DEMO_RUNS) --out $(DEMO_FIGURES)

# Both parts run on two workers (pytest-xdist), a file per worker at a time, so that module fixtures are built
# once; the files that use the SLURM cluster, and those that stop and time whole runs, are two units (tests/conftest.py's
# SERIAL_UNITS), each run in order on one worker beside the rest: most of their time is waiting, not computing.
WORKERS ?= 2

test: install
	$(PY) -m pytest -q -m "not slow" -n $(WORKERS) --dist loadfile --durations=10
	$(PY) -m pytest -q -m slow -n $(WORKERS) --dist loadfile --durations=20

# The part that starts no process (no spawned ranks, CLI runs or SLURM): under 2 minutes.
test-fast: install
	$(PY) -m pytest -q -m "not slow" -n $(WORKERS) --dist loadfile --durations=10

lint: install
	$(VENV)/bin/ruff check .

bench: bench-dp bench-pp bench-pp-dist bench-fsdp bench-tp bench-precision bench-step bench-analysis bench-moe

bench-dp: install
	$(PY) bench/bench_dp.py

bench-pp: install
	$(PY) bench/bench_pp.py

bench-pp-dist: install
	$(PY) bench/bench_pp_dist.py

bench-fsdp: install
	$(PY) bench/bench_fsdp.py

bench-tp: install
	$(PY) bench/bench_tp.py

bench-precision: install
	$(PY) bench/bench_precision.py

# The training step against a bare PyTorch loop and a tuned reference loop (gpt2-mini fp32 on a CPU, gpt2 on a GPU).
bench-step: install
	$(PY) bench/bench_step.py

bench-analysis: install
	$(PY) bench/bench_analysis.py

bench-moe: install
	$(PY) bench/bench_moe.py

# Compressed gradients (parallel.grad_comm): every mode of every sync, bytes and speed, ours against torch's hooks.
bench-comm: install
	$(PY) bench/bench_comm.py

# Compressed communication against fp32 over 300 steps of gpt2-mini on ../shared/data's tinyshakespeare: the table and
# docs/comm_accuracy/loss_vs_fp32.png (16 minutes on 2 loaded cores).
bench-comm-accuracy: install
	$(PY) bench/comm_accuracy.py

# The planner against real runs: calibrate, predict and train 16 layouts, print each error (under 10 minutes idle).
bench-plan: install
	$(PY) bench/bench_plan.py

# Context parallelism on 2 and 4 gloo ranks against one process, ring beside all_to_all, and the longest sequence a
# per-rank attention budget holds at cp = 1, 2, 4 (docs/context_parallel.md).
bench-cp: install
	$(PY) bench/bench_cp.py

figures: install
	$(GPTPAR) report $(RUNS) --out $(FIGURES)

# Rewrite docs/config_reference.md's table from the config classes (tests/e2e/test_readme.py checks it).
config-reference: install
	$(PY) -c "import pathlib, gptpar.config as c; p = pathlib.Path('docs/config_reference.md'); p.write_text(c.with_reference(p.read_text()))"

# Rewrite docs/log_schema.md's table from the record classes (tests/e2e/test_readme.py checks it).
log-reference: install
	$(PY) -c "import pathlib, gptpar.run.records as r; p = pathlib.Path('docs/log_schema.md'); p.write_text(r.with_reference(p.read_text()))"

clean:
	rm -rf $(RUNS) $(FIGURES) .pytest_cache

-include jobs/Makefile.launch
