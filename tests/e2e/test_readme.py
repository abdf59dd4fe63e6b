"""The README and the docs/ pages stay true: the config reference and log schema are generated, every command a
page shows is run by CI, by a test, or here (or is marked as needing a real GPU cluster), every relative link
leads to a file, and the README stays an entry page."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, isolated_environ

from gptpar.cli import main
from gptpar.config import with_reference
from gptpar.run import records

# The README and every page under docs/: the commands, tables and examples they hold are checked together.
PAGES = {path: path.read_text() for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
DOCS = "\n".join(PAGES.values())
README_MAX_LINES = 400  # an entry page, as nanoGPT's and torchtitan's are; the guides live in docs/
CI = (REPO / ".ci" / "run").read_text()
SLURM_TESTS = (REPO / "tests" / "launch" / "test_slurm.py").read_text()

# Commands that .ci/run itself runs.
BY_CI = ["make test", "make cluster-up NODES=2 GPUS_PER_NODE=2", "make cluster-status", "make cluster-down",
         "make install"]
# Commands run by hand, whose output is committed: docs/demo is `make demo`'s report (its sweeps resolve in
# tests/launch/test_launch.py and the same sweep and report code runs on the cluster in tests/launch/test_slurm.py);
# `make figures` is `gptpar report runs`, which the report tests run.
BY_HAND = ["make demo", "make figures",
           # a real calibration takes minutes: `make bench-plan` makes one, tests/plan/test_plan_measure.py a tiny one
           ".venv/bin/python -m gptpar plan calibrate --out calib.json",
           "make bench-moe",  # its table is in docs/models.md; bench/bench_moe.py trains through the trainer's step
           # docs/qwen2_sft: the sweep resolves in tests/launch/test_launch.py, its layouts train like one process
           # in tests/model/test_architectures.py
           ".venv/bin/gptpar sweep sweeps/qwen2_sft.yaml launch.cluster=local --runs-dir runs/sft --wait",
           ".venv/bin/gptpar report runs/sft --out docs/qwen2_sft",
           # docs/report.md, docs/vision.md: sweeps/vit.yaml resolves in tests/launch/test_launch.py; its report, on
           # logs of its shape, is tests/report/test_report_accuracy.py's
           ".venv/bin/gptpar sweep sweeps/vit.yaml launch.cluster=local --runs-dir runs/vit --wait",
           ".venv/bin/gptpar report runs/vit --out figures/vit",
           ".venv/bin/gptpar report runs/vit --out docs/vision"]
# Commands tests/launch/test_slurm.py runs against the local cluster (the string it must contain).
BY_SLURM_TESTS = {"make submit-dp GPUS=2": '"submit-dp", "GPUS=2"',
                  "sbatch --cpus-per-task=1 jobs/pp.sbatch": '"--cpus-per-task=1", str(REPO / "jobs" / "pp.sbatch")',
                  ".venv/bin/gptpar sweep sweeps/ci_small.yaml": '"ci_small.yaml"',
                  ".venv/bin/gptpar submit dp --gpus 2 launch.launcher=submitit":
                      '"submit", "dp", "--gpus", "2", *common, *FOREVER, SUBMITIT',
                  ".venv/bin/gptpar sweep sweeps/ci_small.yaml launch.launcher=submitit": 'str(work / "submitit_runs")'}
# Commands this test runs as written, from a scratch folder.
RUN_HERE = [
    ".venv/bin/gptpar train train.max_steps=20",
    ".venv/bin/gptpar train parallel.dp=2 parallel.dp_sync=ddp train.max_steps=20",
    ".venv/bin/gptpar train parallel.pp_mode=pipeline_parallel parallel.devices=cpu,cpu parallel.chunks=4 "
    "train.max_steps=5",
    ".venv/bin/gptpar train parallel.pp=2 parallel.pp_schedule=zb1p parallel.chunks=4 train.max_steps=5",
    ".venv/bin/gptpar schedule show 1f1b --pp 4 --chunks 8 --out figures/1f1b.png",
    ".venv/bin/gptpar config show parallel.dp=2",
    ".venv/bin/gptpar config show",
    ".venv/bin/gptpar schedule show zb1p --pp 4 --chunks 8",
    ".venv/bin/gptpar status",
    ".venv/bin/gptpar submit dp --gpus 2 --dry-run",
    ".venv/bin/gptpar submit dp --gpus 2 launch.launcher=submitit --dry-run",
    ".venv/bin/gptpar doctor launch.profile=bridges2 launch.account=abc123",
    ".venv/bin/gptpar train parallel.tp=2 parallel.sequence_parallel=true parallel.loss_parallel=true "
    "train.max_steps=5",
    ".venv/bin/gptpar train parallel.tp=2 parallel.dp=2 parallel.dp_sync=fsdp train.max_steps=5",
    ".venv/bin/gptpar train parallel.cp=2 train.max_steps=5",
    ".venv/bin/gptpar train parallel.dp=2 parallel.cp=2 parallel.cp_impl=all_to_all parallel.dp_sync=zero2 "
    "train.max_steps=5",
    ".venv/bin/gptpar train parallel.dp=2 parallel.dp_sync=zero2 parallel.offload=optimizer train.max_steps=5",
    ".venv/bin/gptpar train parallel.dp_sync=zero2 parallel.offload=optimizer train.max_steps=5",
    ".venv/bin/gptpar train model.preset=qwen2-tiny data.task=sft data.source=metamath_sample data.tokenizer=bytes "
    "data.max_source_len=116 data.max_target_len=120 train.max_steps=5 train.answer_samples=8",
    ".venv/bin/gptpar submit dp --gpus 2 model.preset=qwen2-moe-tiny parallel.ep=2 --dry-run",
    ".venv/bin/gptpar train model.preset=vit-tiny data.task=classify data.source=synthetic train.batch_size=32 "
    "train.lr=1e-3 train.max_steps=40 train.eval_every=20",
]
# Commands this test runs as written, one after the other in one scratch folder (a later one reads an earlier run).
RUN_HERE_IN_ORDER = [
    ".venv/bin/gptpar train train.precision=bf16 train.activation_checkpointing=block train.max_steps=2",
    ".venv/bin/gptpar train parallel.dp=2 train.profile_steps=3-4 train.max_steps=5 log.run_id=traced",
    ".venv/bin/gptpar trace traced --top 5",
    ".venv/bin/gptpar train log.tensorboard=true log.wandb=offline train.max_steps=5",
    ".venv/bin/gptpar train model.preset=qwen2-tiny train.lora_rank=8 train.activation_checkpointing=block "
    "train.max_steps=5 log.run_id=lora",
    ".venv/bin/gptpar checkpoint export lora",
    ".venv/bin/gptpar checkpoint export lora --merge",
]
# Commands that need a real GPU cluster (an account, CUDA wheels, environment modules).
CLUSTER_ONLY = [
    "module load anaconda3",
    # a V100 calibration, made on a Bridges-2 GPU node
    ".venv/bin/python -m gptpar plan calibrate --out v100.json",
    ".venv/bin/gptpar plan search --model gpt2-xl --gpus 8 --profile bridges2 --calibration v100.json "
    "data.seq_len=1024 --top 5",
    ".venv/bin/gptpar plan search --model gpt2-xl --gpus 64 --profile bridges2 --calibration v100.json "
    "data.seq_len=1024 --sweep xl64.yaml",
    "sbatch jobs/pp.sbatch",
    ".venv/bin/gptpar submit pp --gpus 4 parallel.pp=4 parallel.pp_schedule=1f1b parallel.chunks=8",
    'make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"',
    # the README's first run: Bridges-2's $PROJECT and a real account (the dry run of its submit is checked below)
    "export PIP_CACHE_DIR=$PROJECT/.cache/pip HF_HOME=$PROJECT/.cache/huggingface GPTPAR_DATA_DIR=$PROJECT/gptpar-data",
    ".venv/bin/gptpar submit dp --gpus 2 launch.account=abc123",
    # docs/report.md: ViT-Huge on CIFAR-100 (issue 49)
    ".venv/bin/gptpar sweep sweeps/vit.yaml model.preset=vit-huge data.source=cifar100 launch.profile=bridges2 "
    "launch.account=abc123 launch.time=08:00:00 train.max_steps=0 train.epochs=3 train.eval_every=500 "
    "train.eval_batches=40 --runs-dir runs/vit-huge",
]
# `gptpar plan` commands that read calib.json: run here, in this process, on a synthetic calibration of this machine
# (tests/plan/ holds the predictions' arithmetic).
WITH_CALIBRATION = [
    ".venv/bin/gptpar plan predict parallel.dp=2 parallel.dp_sync=zero2 --calibration calib.json",
    ".venv/bin/gptpar plan predict parallel.dp_sync=fsdp2 parallel.offload=params --calibration calib.json",
    ".venv/bin/gptpar plan predict parallel.pp=2 parallel.pp_schedule=zb1p parallel.chunks=4 --calibration calib.json "
    "--json",
    ".venv/bin/gptpar plan search --model gpt2-mini --gpus 2 --profile local --calibration calib.json --top 5 "
    "--sweep top.yaml",
]
# Commands that need the Hugging Face hub (tests/data/test_translation.py runs the same keys on a local fixture; the
# pretrained folder's, tests/model/test_pretrained_folder.py on folders it writes with save_pretrained).
NEEDS_HUB = [
    ".venv/bin/python -c \"from huggingface_hub import snapshot_download; snapshot_download("
    "'Qwen/Qwen2.5-0.5B-Instruct', local_dir='models/qwen2.5-0.5b-instruct')\"",
    ".venv/bin/gptpar submit dp --gpus 4 model.init=pretrained:models/qwen2.5-0.5b-instruct data.task=sft "
    "data.source=metamath_sample",
    ".venv/bin/gptpar submit dp --gpus 1 model.init=pretrained:models/qwen2.5-0.5b-instruct data.task=sft "
    "data.source=metamath_sample train.lora_rank=16 train.activation_checkpointing=block",
    ".venv/bin/gptpar train data.task=translation data.source=hf:bbaaaa/iwslt14-de-en-preprocess data.max_chars=0 "
    "model.preset=gpt2-mini train.epochs=10 train.batch_size=64",
    # docs/vision.md's image sets: tests/data/test_image_sets.py reads sets saved in the same layout and runs the
    # download path from a local image folder
    ".venv/bin/gptpar data fetch cifar100",
    ".venv/bin/gptpar data fetch food101",
    ".venv/bin/gptpar data fetch hf:AI-Lab-Makerere/beans data.task=classify",
]
# Commands that write the reader's own files (tests/launch/test_user_defaults.py covers what they set up).
USERS_OWN = [
    "mkdir -p ~/.config/gptpar",
    "printf 'launch:\\n  profile: bridges2\\n  account: abc123\\n' > ~/.config/gptpar/config.yaml",
]


ACCOUNTS = [BY_CI, BY_HAND, list(BY_SLURM_TESTS), RUN_HERE, RUN_HERE_IN_ORDER, CLUSTER_ONLY, USERS_OWN, NEEDS_HUB,
            WITH_CALIBRATION]


def page_commands(text: str) -> list[str]:
    """Every command line of a page's bash blocks, comments stripped."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_every_command_of_every_page_is_accounted_for_once():
    shown = {command: page.name for page, text in PAGES.items() for command in page_commands(text)}
    listed = [command for account in ACCOUNTS for command in account]
    twice = sorted({command for command in listed if listed.count(command) > 1})
    assert not twice, f"commands accounted for twice: {twice}"
    unaccounted = [f"{page}: {command}" for command, page in shown.items() if command not in listed]
    assert not unaccounted, f"commands run by nothing: {unaccounted}"
    stale = sorted(set(listed) - set(shown))
    assert not stale, f"commands listed here but gone from README.md and docs/: {stale}"


def test_the_readme_is_an_entry_page():
    lines = PAGES[REPO / "README.md"].count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the detail to a page under docs/"


LINK = re.compile(r"\]\(([^()\s]+)\)")  # a markdown link's or image's target


def test_every_relative_link_leads_to_a_file():
    broken = [f"{page.relative_to(REPO)}: {target}" for page, text in PAGES.items() for target in LINK.findall(text)
              if not re.match(r"[a-z]+:|#", target) and not (page.parent / target.split("#")[0]).exists()]
    assert not broken, f"links to nothing: {broken}"


@pytest.mark.parametrize("command", WITH_CALIBRATION)
def test_plan_commands_run_on_a_calibration_of_this_machine(command: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from gptpar.plan.calibration import Calibration, installed_torch, local_device_name

    points = {kind: [[1e6, 1e-4], [1e9, 1e-2]] for kind in ("block_f", "block_b", "block_w", "head_f", "head_bw")}
    links = {op: [[4096.0, 1e-4], [2.0**20, 1e-3]] for op in ("all_reduce", "reduce_scatter", "all_gather",
                                                              "all_to_all", "send_recv")}
    calib = Calibration("cpu", local_device_name(), "gloo", "fp32", installed_torch(), 1, "2026-11-27", "test", 2,
                        {**points, "optimizer": [[1e5, 1e-3], [1e7, 1e-1]]}, 100.0, links)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "calib.json").write_text(calib.to_json())
    assert main(shlex.split(command)[1:]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert json.loads(out)["step_time_s"] > 0 if "--json" in command else "step" in out


def test_ci_and_slurm_tests_run_their_commands():
    for command in BY_CI:
        assert re.search(rf"^{re.escape(command)}$", CI, flags=re.M), f".ci/run does not run {command!r}"
    for command, needle in BY_SLURM_TESTS.items():
        assert needle in SLURM_TESTS, command


def test_config_reference_is_current():
    page = PAGES[REPO / "docs" / "config_reference.md"]
    assert "<!-- config-reference:start -->" in page
    assert with_reference(page) == page, "run `make config-reference` and commit docs/config_reference.md"


def test_log_reference_is_current():
    page = PAGES[REPO / "docs" / "log_schema.md"]
    assert "<!-- log-reference:start -->" in page
    assert records.with_reference(page) == page, "run `make log-reference` and commit docs/log_schema.md"


SUBMIT_EXAMPLE = re.compile(r"gptpar submit (?:dp|pp)\b(?:[^`\n#:]|:(?!\s))*")  # up to a comment or a ": "
PLACEHOLDER = re.compile(r"(?:^|\s)[A-Z]+/")  # `gptpar submit dp RUN/config.yaml`: a pattern, not an example
# The Qwen folder docs/models.md fetches from the hub: a stand-in with its shape, enough for a dry run.
QWEN_CONFIG = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
               "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
               "max_position_embeddings": 32768, "tie_word_embeddings": True}


def submit_examples() -> list[str]:
    """Every `gptpar submit` example of the pages, in a bash block or inline, with its arguments; `make submit-dp
    GPUS=N` is `gptpar submit dp --gpus N`."""
    found = {match.group(0).strip() for match in SUBMIT_EXAMPLE.finditer(DOCS)
             if not PLACEHOLDER.search(match.group(0))}
    return sorted(found | {f"gptpar submit dp --gpus {n}" for n in re.findall(r"make submit-dp GPUS=(\d+)", DOCS)})


@pytest.mark.parametrize("example", submit_examples())
def test_every_submit_example_is_accepted_under_its_profile(example: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The pages show their cluster path with `bridges2` (or names the profile in the example): each example is
    rendered under that profile with --dry-run, in this process, and must be accepted as written."""
    monkeypatch.chdir(tmp_path)
    words = shlex.split(example)[2:]
    init = next((w.split("pretrained:", 1)[1] for w in words if w.startswith("model.init=pretrained:")), None)
    if init:  # fetched once on a login node (docs/models.md)
        (tmp_path / init).mkdir(parents=True)
        (tmp_path / init / "config.json").write_text(json.dumps(QWEN_CONFIG))
        (tmp_path / init / "model.safetensors").touch()
        (tmp_path / init / "tokenizer.json").write_text("{}")
    profile = [] if any(w.startswith("launch.profile=") for w in words) else ["launch.profile=bridges2"]
    assert main(["submit", *words, *profile, "--dry-run"]) == 0, capsys.readouterr().err
    assert "srun" in capsys.readouterr().out or "launch.launcher=submitit" in words


def run_here(command: str, folder: Path, environ: dict[str, str]) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    argv[0] = str(REPO / argv[0])
    env = {**environ, "OMP_NUM_THREADS": "1", "PATH": f"{REPO / '.venv' / 'bin'}:{environ['PATH']}",
           "WANDB_DIR": str(folder), "WANDB_CACHE_DIR": str(folder), "WANDB_CONFIG_DIR": str(folder)}
    out = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


IN_ORDER = "RUN_HERE_IN_ORDER"  # the key of the one job that runs those commands in turn
STARTED_BY = ("test_readme_commands_in_order_run", "test_readme_command_runs")  # the tests `started` serves


def run_job(key: str, folder: Path, environ: dict[str, str]) -> Any:
    """IN_ORDER: every RUN_HERE_IN_ORDER command in turn in `folder` (their outputs); else the command `key`."""
    if key == IN_ORDER:
        return [run_here(command, folder, environ) for command in RUN_HERE_IN_ORDER]
    if "status" in shlex.split(key):
        (folder / "runs").mkdir()
    return run_here(key, folder, environ)


@pytest.fixture(scope="module")
def started(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            data_dir: Path) -> Iterator[dict[str, tuple[Path, Future]]]:
    """The selected tests' commands, started at once and run two at a time in test order, each job in a scratch
    folder of its own: most train one process on one core, and two keep this machine's two cores busy. Each test
    then checks its own job's outcome (a failed command raises there)."""
    environ = isolated_environ(os.environ, data_dir)  # the tests' own, which this module's threads cannot rely on
    keys = [IN_ORDER if item.originalname == STARTED_BY[0] else item.callspec.params["command"]
            for item in request.session.items if item.module is request.module and item.originalname in STARTED_BY]
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = {}
        for key in keys:
            folder = tmp_path_factory.mktemp("readme")
            jobs[key] = folder, pool.submit(run_job, key, folder, environ)
        yield jobs
        pool.shutdown(cancel_futures=True)


@pytest.mark.slow
def test_readme_commands_in_order_run(started):
    folder, future = started[IN_ORDER]
    outputs = future.result()
    runs = folder / "runs"
    assert "overlap share" in outputs[2].stdout and "rank 1: top 5 ops" in outputs[2].stdout
    assert list(runs.glob("*/tb/events.out.tfevents.*")) and list(runs.glob("*/wandb/offline-run-*"))
    assert (runs / "lora" / "adapter" / "adapter_model.safetensors").is_file()
    assert (runs / "lora" / "merged" / "model.safetensors").is_file()


@pytest.mark.parametrize("command", RUN_HERE)
@pytest.mark.slow
def test_readme_command_runs(command, started):
    argv = shlex.split(command)
    folder, future = started[command]
    out = future.result()
    if argv[1] == "train":
        assert list((folder / "runs").glob("*/rank0.jsonl")), "no run folder written"
    if "--dry-run" in argv and "launch.launcher=submitit" in argv:
        assert out.stdout.startswith("# submitit AutoExecutor(") and "\nslurm_signal_delay_s=120\n" in out.stdout
    elif "--dry-run" in argv:
        assert out.stdout.startswith("#!/bin/bash") and "srun" in out.stdout


def test_the_llama_family_preset_table_is_the_closed_form():
    from gptpar.presets import PRESETS

    rows = re.findall(r"^  \| `([\w.-]+)` \| (\w+) \| (\d+) \| ([\d,]+) \| (\d+) \((\d+)\) \| ([\d,]+) \| (\w+) \| "
                      r"([\d,.]+) M \(([\d,]+)\) \|$", DOCS, flags=re.M)
    assert [row[0] for row in rows] == ["llama-tiny", "qwen2-tiny", "qwen2.5-0.5b", "llama-3.2-1b", "qwen2.5-3b"]
    for name, arch, layers, width, heads, kv, mlp, head, millions, vocab in rows:
        shape = PRESETS[name]
        number = lambda text: int(text.replace(",", ""))  # noqa: E731
        assert (shape.arch, shape.n_layer, shape.n_embd, shape.n_head, shape.kv_heads, shape.mlp_width) == (
            arch, int(layers), number(width), int(heads), int(kv), number(mlp)), name
        assert head == ("tied" if shape.tied else "untied"), name
        digits = 1 if "." in millions else 0
        assert f"{shape.parameters(number(vocab)) / 1e6:,.{digits}f}" == millions, name


def test_the_mixture_preset_table_is_the_closed_form():
    from gptpar.presets import PRESETS

    rows = re.findall(r"^  \| `([\w.-]+)` \| (\w+) \| (\d+) \| ([\d,]+) \| (\d+) \((\d+)\) \| ([\d,]+) \| "
                      r"([\d,]+|none) \| ([\d,.]+) M, ([\d,.]+) M \(([\d,]+)\) \|$", DOCS, flags=re.M)
    assert [row[0] for row in rows] == ["qwen2-moe-tiny", "mixtral-tiny", "qwen1.5-moe-a2.7b", "mixtral-8x7b"]
    number = lambda text: int(text.replace(",", ""))  # noqa: E731
    for name, arch, layers, width, experts, top_k, mlp, shared, total, active, vocab in rows:
        shape = PRESETS[name]
        assert (shape.arch, shape.n_layer, shape.n_embd, shape.n_experts, shape.top_k, shape.mlp_width) == (
            arch, int(layers), number(width), int(experts), int(top_k), number(mlp)), name
        assert shape.shared_inner == (0 if shared == "none" else number(shared)), name
        digits = 1 if "." in total else 0
        assert f"{shape.parameters(number(vocab)) / 1e6:,.{digits}f}" == total, name
        assert f"{shape.active_parameters(number(vocab)) / 1e6:,.{digits}f}" == active, name


def test_the_bridges2_preset_table_is_the_closed_form():
    from analysis.aggregate import closed_form_state_bytes
    from gptpar.presets import PRESETS

    rows = re.findall(r"^  \| `(gpt2[\w-]*)` \| (\d+) M \| (.*) \|$", DOCS, flags=re.M)
    assert [name for name, _, _ in rows] == ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]
    for name, millions, cells in rows:
        n = PRESETS[name].parameters(50257)
        assert int(millions) == round(n / 1e6)
        expected = [closed_form_state_bytes(s, n, w) / 2**30 for s, w in (("ddp", 1), ("zero2", 4), ("fsdp", 4),
                                                                           ("fsdp", 8))]
        assert cells.split(" | ") == [f"{gib:.1f} GiB" for gib in expected], name
