"""`gptpar`: train GPT-2, show the config, submit jobs and sweeps, watch them, and report on them.

Every subcommand is defined here, with one error format: `gptpar: error: <one line>` and exit code 2
for bad input. Heavy modules (torch, the trainer, matplotlib) are imported by the commands that need
them, so `gptpar status` and `gptpar submit --dry-run` answer at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

from gptpar import __version__
from gptpar.config import reference_markdown, shape_values, split_config_args, to_yaml_with_origins
from gptpar.errors import GptparError
from gptpar.paths import check_path
from gptpar.strategies.data_parallel import either
from gptpar.strategies.pipeline import SCHEDULES

CONFIG_ARGS = "[CONFIG.yaml] [section.key=value ...]"


class Parser(argparse.ArgumentParser):
    """argparse with gptpar's error format, for bad options as for bad values."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"gptpar: error: {message} (see `{self.prog} --help`)\n")


def _config(args: argparse.Namespace, user: bool = True):
    """The config of the command line, over the user's defaults unless this process is a job's rank."""
    return _resolved(args.words, user)[0]


def _resolved(words: list[str], user: bool = True):
    from gptpar.user_defaults import resolve_config

    return resolve_config(*split_config_args(words), user=user)


def _train_here(cfg, reshape: bool = False) -> int:
    """Train as this process's rank; the exit code says whether the run ended as it should."""
    from gptpar.train.entry import run_rank

    return 0 if run_rank(cfg, reshape)["status"] in ("completed", "diverged", "requeued") else 1


def _run_path(args: argparse.Namespace, sweeps: bool = False) -> Path:
    """`RUN` as a path, or as a name under --runs-dir: a run's folder, or with `sweeps` also a folder of runs."""
    from gptpar.run.folder import find_runs, holds_run

    places = (Path(args.run), Path(args.runs_dir) / args.run)
    path = next((p for p in places if p.is_dir()), None) or next((p for p in places if p.exists()), None)
    if path is None:
        raise GptparError(f"run {args.run!r} not found (as a path or under {args.runs_dir})")
    check_path(path, "folder", "run", "name a run folder")
    runs = [] if sweeps or holds_run(path) else find_runs(path)
    if runs:
        raise GptparError(f"{str(path)!r} is a folder of {len(runs)} runs, not one run; name one of them (e.g. "
                          f"{runs[0].path}), or see them all with `gptpar status {path}`")
    return path


def cmd_train(args: argparse.Namespace) -> int:
    from gptpar.train.preemption import install_preemption_handler

    install_preemption_handler()  # before torch is imported: a job's USR2 may come early
    from gptpar.launch.train_command import train_here_or_start_ranks, users_own_command
    from gptpar.parallel.env import layout_from_env

    layout = layout_from_env(os.environ)
    if args.dump_grads is not None:
        args.words = [*args.words, f"train.dump_grads={args.dump_grads}"]
    cfg = _config(args, user=users_own_command(layout))
    return train_here_or_start_ranks(cfg, layout, args.start_over, _train_here, args.reshape)


def cmd_config(args: argparse.Namespace) -> int:
    if args.action == "reference":
        print(reference_markdown())
        return 0
    from gptpar.launch.profiles import profile_values

    cfg, origins = _resolved(args.words)
    print(to_yaml_with_origins(cfg, origins, {**shape_values(cfg), **profile_values(cfg)}), end="")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from gptpar.config import data_config
    from gptpar.data.fetch import fetch

    print(fetch(data_config(_resolved([*args.words, f"data.source={args.source}"])[0])))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from gptpar.doctor import render, run_checks

    checks = run_checks(*_resolved(args.words))
    print(render(checks))
    return 1 if any(c.status == "broken" for c in checks) else 0


def cmd_submit(args: argparse.Namespace) -> int:
    from gptpar.launch.submit import dp_set_by, submit

    overrides = list(args.words)
    if args.gpus is not None:
        overrides.append(f"launch.gpus={args.gpus}")
    if args.nodes is not None:
        overrides.append(f"launch.nodes={args.nodes}")
    if args.runs_dir is not None:
        overrides.append(f"log.runs_dir={args.runs_dir}")
    cfg, origins = _resolved(overrides)
    return submit(cfg, args.kind, dry_run=args.dry_run, reshape=args.reshape,
                  dp_set=dp_set_by(split_config_args(overrides)[0], origins))


def cmd_sweep(args: argparse.Namespace) -> int:
    from gptpar.launch.sweep import run_sweep

    return run_sweep(args.file, dry_run=args.dry_run, runs_dir=args.runs_dir or "", overrides=args.overrides,
                     wait=args.wait, rerun=args.rerun)


def cmd_status(args: argparse.Namespace) -> int:
    import time

    from gptpar.launch.status import STATES, any_live, parse_states, render_status, status_rows

    root = check_path(args.runs_dir, "folder", "runs folder")
    states = parse_states(args.state) if args.state is not None else STATES
    while True:
        rows, aside = status_rows(root, states=states)
        if args.watch and sys.stdout.isatty():
            print("\033[2J\033[H", end="")  # redraw in place, as watch(1) does
        print(render_status(rows, aside), flush=True)
        if not args.watch or not any_live(rows):
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


def _target(args: argparse.Namespace, sweeps: bool = False):
    """What `RUN` names for cancel and logs: a run's folder (or with `sweeps` a folder of runs) as a path, as
    `gptpar status` shows it under --runs-dir, or by its job id; with the live job of a plain sbatch script that runs
    it (SLURM alone knows such a job until its trainer writes the folder), or None."""
    from gptpar.launch.status import plain_job_named, run_of_job

    runs_dir = Path(args.runs_dir)
    job = plain_job_named(args.run, runs_dir)
    if job is not None:
        return job.run, job
    if any(p.exists() for p in (Path(args.run), runs_dir / args.run)):
        return _run_path(args, sweeps), None  # a path of the wrong kind is named as such, not as missing
    if (folder := run_of_job(args.run, runs_dir)) is None:
        raise GptparError(f"run {args.run!r} not found (as a path, a run or a job id under {args.runs_dir})")
    return folder.path, None


def cmd_cancel(args: argparse.Namespace) -> int:
    from gptpar.launch.backend import cancel_run
    from gptpar.run.folder import RunFolder, find_runs

    path, job = _target(args, sweeps=True)
    if job is not None:
        print(f"{path}: {cancel_run(RunFolder(path), ('slurm', job.job_id))}")
        return 0
    for folder in find_runs(path) or [RunFolder(path)]:  # a sweep's (or a runs folder's) runs, or one run
        print(f"{folder.path}: {cancel_run(folder)}")
    return 0


def cmd_debug(args: argparse.Namespace) -> int:
    from gptpar.launch.debug import debug_run
    from gptpar.run.folder import RunFolder

    path, job = _target(args)
    print(debug_run(RunFolder(path), ("slurm", job.job_id) if job is not None else None, args.wait), flush=True)
    return 0


def _print_rank_log(folder, args: argparse.Namespace) -> None:
    """Rank 0's last --lines records as lines; with -f, each new one while the run is live; then what it wrote as
    it ended."""
    import time

    from gptpar.launch.backend import scheduler_state
    from gptpar.run.logfile import format_record, read_new_records
    from gptpar.run.state import LIVE_JOB_STATES, read_run

    records, offset = read_new_records(folder.rank_log(0), 0)
    print("\n".join(format_record(r) for r in (records[-args.lines:] if args.lines else [])), flush=True)
    try:
        while args.follow and read_run(folder, scheduler=scheduler_state(folder)).state in LIVE_JOB_STATES:
            time.sleep(1.0)
            records, offset = read_new_records(folder.rank_log(0), offset)
            for record in records:
                print(format_record(record), flush=True)
    except KeyboardInterrupt:
        pass
    records, _ = read_new_records(folder.rank_log(0), offset)  # what the run wrote as it ended
    print("".join(f"{format_record(r)}\n" for r in records), end="")


def cmd_logs(args: argparse.Namespace) -> int:
    from gptpar.launch.backend import scheduler_state
    from gptpar.run.folder import RunFolder
    from gptpar.run.logfile import CorruptLog
    from gptpar.run.state import read_run

    path, job = _target(args)
    folder = RunFolder(path)
    scheduler = job.state if job is not None else scheduler_state(folder)
    files = sorted(p for p in folder.job_dir.glob("*") if p.suffix in (".out", ".err") and p.stat().st_size)
    for file in files:
        print(f"==> {file} <==")
        print("\n".join(file.read_text(errors="replace").splitlines()[-args.lines:]))
    print(f"==> {folder.rank_log(0)} <==")
    try:
        _print_rank_log(folder, args)
    except CorruptLog as exc:  # said where the records would be; the state below is `corrupt`, as in `gptpar status`
        print(f"unreadable: {exc}")
    run = read_run(folder, scheduler=scheduler)
    print(f"state: {run.state}" + (f" ({run.detail})" if run.detail else ""))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from analysis.report import report

    group_by = [key for words in args.group_by for key in words.split(",") if key]
    result = report(args.runs_dir, args.out, args.warmup_epochs, args.warmup_steps, args.include_incomplete,
                    peak_flops=args.peak_flops, group_by=group_by, x=args.x, fmt=args.format, dpi=args.dpi,
                    target_loss=args.target_loss, include_running=args.include_running)
    for message in [*result.skipped, *(f"left out: {note}" for note in result.left_out)]:
        print(message)
    for run in result.runs:
        for straggler in run.stragglers:
            print(f"straggler: run {run.run}: {straggler.sentence()}")
    completed = sum(r.status == "completed" for r in result.runs)
    print(f"{len(result.runs)} run(s), {completed} completed; {len(result.shown)} in the table")
    print(f"summary: {result.summary_md} and {result.summary_csv}")
    print(f"figures: {len(result.figures)} in {Path(args.out)}/" + "".join(f"\n  {p.name}" for p in result.figures))
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    from gptpar.strategies.pipeline import (
        closed_form_bubble,
        peak_activations,
        schedule,
        schedule_shape,
        simulate,
        text_chart,
    )

    if args.out:  # before the simulation: a chart that cannot be written is refused first
        from analysis.canvas import check_format

        out = check_path(args.out, "file", "--out", "name a file to write", must_exist=False)
        check_format(out.suffix.lstrip(".").lower(), f"--out {args.out!r} (by its suffix)")
    ranks = schedule(args.name, args.pp, args.chunks, args.virtual)
    split = schedule_shape(args.name, args.pp, args.chunks, args.virtual).split_backward
    timeline = simulate(ranks, args.cost_f, args.cost_b, args.cost_w, split_backward=split)
    print(f"{args.name}: P={args.pp} ranks, m={args.chunks} micro-batches, V={args.virtual} stage(s) per rank; "
          f"costs F={args.cost_f:g} B={args.cost_b:g} W={args.cost_w:g} (a whole backward is B+W)")
    if timeline.makespan <= 200:
        print(text_chart(timeline, args.pp))
    print("idle share per rank: " + " ".join(f"{i:.3f}" for i in timeline.idle) + f"; mean {timeline.bubble:.3f}")
    if args.cost_f == args.cost_b == args.cost_w:
        print(f"closed form for unit costs: {closed_form_bubble(args.name, args.pp, args.chunks, args.virtual):.3f}")
    print("peak micro-batches of activations per rank: " + " ".join(str(peak_activations(a)) for a in ranks))
    if args.out:
        from analysis.figures import schedule_gantt

        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # no permission, say; a file in the way was refused above
            raise GptparError(f"cannot create the folder {str(out.parent)!r} for --out ({exc.strerror})") from None
        title = f"{args.name}, P={args.pp}, m={args.chunks}, V={args.virtual}: idle {timeline.bubble:.1%}"
        print(f"wrote {schedule_gantt(timeline, args.pp, title, out)}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if args.action == "calibrate":
        from gptpar.plan.measure import calibrate, dump

        out = check_path(args.out, "file", "--out", "name a file to write", must_exist=False)
        calib = calibrate(out, quick=args.quick, world=args.world, threads=args.threads, precision=args.precision)
        print(f"wrote {out}: {dump(calib)}")
        return 0
    if args.action == "predict":
        from gptpar.plan.commands import as_json, as_text, predict_config

        cfg = _config(args)
        layout, target, pred = predict_config(cfg, args.calibration)
        steps = args.steps or cfg.train.max_steps or 1000
        print(as_json(layout, target, pred, steps) if args.json else as_text(layout, target, pred, steps))
        return 0
    from gptpar.plan.search import search_command

    return search_command(args, lambda words: _resolved(words)[0])


def cmd_trace(args: argparse.Namespace) -> int:
    import json

    from analysis.holistic import hta_table, with_hta
    from analysis.trace import analyse_run, table, trace_files
    from gptpar.run.folder import RunFolder

    run = _run_path(args)
    ranks, skipped = analyse_run(run, args.top)
    for message in skipped:
        print(message, file=sys.stderr)
    if not ranks:
        raise GptparError(f"no readable trace in {RunFolder(run).trace_dir}")
    ranks, note = with_hta(ranks, dict(trace_files(run)))
    if note:
        print(note, file=sys.stderr)
    if args.json:
        print("\n".join(json.dumps(r.to_dict()) for r in ranks))
    else:
        print(table(ranks, hta_table(ranks) if any(r.hta for r in ranks) else ""))
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    from gptpar.run.folder import ADAPTER_FOLDER, EXPORT_FILE, MERGED_FOLDER
    from gptpar.train.checkpoint import export_checkpoint, export_lora, trained_lora

    run = _run_path(args)
    if args.merge or trained_lora(run):
        out = Path(args.out or run / (MERGED_FOLDER if args.merge else ADAPTER_FOLDER))
        print(f"wrote {export_lora(run, out, args.merge)}")
        return 0
    out = Path(args.out or run / EXPORT_FILE)
    print(f"wrote {export_checkpoint(run, out)}")
    return 0


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def _add(sub: argparse._SubParsersAction, name: str, help: str, examples: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=help, epilog=f"examples:\n{examples}",
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="gptpar", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"gptpar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)

    p = _add(sub, "train", "train GPT-2 here: one process, or parallel.dp local ranks (a rank of the job "
             "when started by srun or torchrun)",
             "  gptpar train train.max_steps=20\n"
             "  gptpar train my.yaml parallel.dp=2 parallel.dp_sync=ddp\n"
             "  torchrun --nproc-per-node=2 -m gptpar train parallel.dp=2\n"
             "  gptpar train log.run_id=lr-test train.lr=1e-3 --start-over\n"
             "  gptpar train runs/dp2/config.yaml parallel.dp=1 --reshape   # continue a stopped run on one rank\n"
             "  gptpar train parallel.dp=2 train.max_steps=1 --dump-grads tests   # the assignment's gradient check")
    p.add_argument("words", nargs="*", metavar=CONFIG_ARGS)
    p.add_argument("--start-over", action="store_true",
                   help="if the run folder (log.run_id) exists, move it aside to <folder>.replaced-<time> and "
                        "train from scratch (a live run's folder is never touched)")
    p.add_argument("--reshape", action="store_true",
                   help="continue a stopped run on another layout (parallel.*, train.grad_accum): its checkpoint "
                        "reshards and its data order carries over; the model and train.batch_size stay")
    p.add_argument("--dump-grads", metavar="DIR",
                   help="after the last step, each rank saves its synced gradients to DIR/model<RANK>_gradients.pth "
                        "(train.dump_grads; the assignment's gradient check)")
    p.set_defaults(handler=cmd_train)

    p = _add(sub, "config", "print the resolved config, or the reference of every key",
             "  gptpar config show parallel.dp=2\n  gptpar config reference")
    p.add_argument("action", choices=("show", "reference"))
    p.add_argument("words", nargs="*", metavar=CONFIG_ARGS)
    p.set_defaults(handler=cmd_config)

    p = _add(sub, "data", "fetch a hub dataset (data.source=hf:...) and GPT-2's tokenizer into the local cache, or "
             "an image set (cifar100, food101, hf:... data.task=classify) into the data folder, on a machine that "
             "reaches the hub (a login node), for compute nodes without internet",
             "  gptpar data fetch hf:bbaaaa/iwslt14-de-en-preprocess\n"
             "  gptpar data fetch hf:wikitext:wikitext-2-raw-v1\n"
             "  gptpar data fetch cifar100")
    p.add_argument("action", choices=("fetch",))
    p.add_argument("source", help="a data.source, e.g. hf:NAME[:CONFIG] or cifar100")
    p.add_argument("words", nargs="*", metavar=CONFIG_ARGS)
    p.set_defaults(handler=cmd_data)

    p = _add(sub, "submit", "submit one run as a job: data-parallel (dp) or the one-process pipeline (pp); "
             "on SLURM when it answers, else as local processes",
             "  gptpar submit dp --gpus 2 --dry-run\n"
             "  gptpar submit dp --gpus 8 --nodes 2 launch.profile=bridges2 launch.partition=GPU "
             "launch.account=abc123\n"
             "  gptpar submit pp --gpus 2 parallel.chunks=8 --runs-dir runs/pp")
    p.add_argument("kind", choices=("dp", "pp"))
    p.add_argument("--gpus", type=_non_negative, help="GPUs per node (launch.gpus); dp runs one rank per GPU")
    p.add_argument("--nodes", type=_non_negative, help="nodes (launch.nodes)")
    p.add_argument("--runs-dir", help="where the run folder goes (log.runs_dir)")
    p.add_argument("--dry-run", action="store_true", help="print the job script and submit nothing")
    p.add_argument("--reshape", action="store_true",
                   help="continue a stopped run (RUN/config.yaml) on another layout, as gptpar train --reshape")
    p.add_argument("words", nargs="*", metavar=CONFIG_ARGS)
    p.set_defaults(handler=cmd_submit)

    p = _add(sub, "sweep", "submit every point of a sweep file that is not done or queued yet",
             "  gptpar sweep sweeps/dp_scaling.yaml\n  gptpar sweep sweeps/ci_small.yaml --dry-run\n"
             "  gptpar sweep sweeps/demo_dp.yaml launch.cluster=local --runs-dir runs/demo --wait")
    p.add_argument("file", help="sweep YAML: name, kind, config, base, grid, zip")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="applied to every point's base")
    p.add_argument("--dry-run", action="store_true", help="print the points and job scripts only")
    p.add_argument("--wait", action="store_true", help="on SLURM, return once every point has finished")
    p.add_argument("--rerun", action="store_true",
                   help="start over the points whose folders hold results of a different config (after an edit "
                        "of the sweep or its base); their folders are kept as <point>.replaced-<time>")
    p.add_argument("--runs-dir", help="override log.runs_dir of the sweep's points")
    p.set_defaults(handler=cmd_sweep)

    p = _add(sub, "doctor", "check this install and node: packages, torch build and GPU architectures, NCCL, "
             "SLURM, profile and account, free space (exit 1 only when the install is broken)",
             "  gptpar doctor\n  gptpar doctor launch.profile=bridges2 launch.account=abc123")
    p.add_argument("words", nargs="*", metavar=CONFIG_ARGS)
    p.set_defaults(handler=cmd_doctor)

    p = _add(sub, "status", "the runs as a table by state (pending, running, completed, failed, ...): job id, "
             "elapsed since the job started, step/total, ETA, loss, tokens/s, nodes, restarts, asking SLURM about "
             "their jobs", "  gptpar status\n  gptpar status runs/demo\n  gptpar status --watch 30\n"
             "  gptpar status --state running,pending")
    p.add_argument("runs_dir", nargs="?", default="runs", help="folder of run folders (default: runs)")
    p.add_argument("--watch", type=_positive_number, nargs="?", const=10.0, default=None, metavar="SECONDS",
                   help="redraw every SECONDS (default 10) until no run is pending or running")
    p.add_argument("--state", metavar="STATE[,STATE...]",
                   help="list only runs in these states (e.g. running,pending); the count line counts those")
    p.set_defaults(handler=cmd_status)

    p = _add(sub, "cancel", "stop a run, or every run of a sweep: scancel its live SLURM job, or interrupt a local "
             "run (its ranks stop at a step boundary and it can be resumed)",
             "  gptpar cancel dp2\n  gptpar cancel runs/ci_small")
    p.add_argument("run", help="run or sweep folder, or its name under --runs-dir")
    p.add_argument("--runs-dir", default="runs")
    p.set_defaults(handler=cmd_cancel)

    p = _add(sub, "debug", "ask a running run's ranks for their stacks and flight recorders (SIGQUIT, through its "
             "launcher or SLURM) and say which collective they wait in, who holds it up and each rank's file:line; "
             "the run goes on", "  gptpar debug dp2\n  gptpar debug runs/demo/dp2")
    p.add_argument("run", help="run folder, or its name or job id under --runs-dir")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--wait", type=_positive_number, default=5.0, metavar="SECONDS",
                   help="how long to wait for the ranks' dumps (default 5; a stopped rank never answers)")
    p.set_defaults(handler=cmd_debug)

    p = _add(sub, "logs", "tail a run's job output, its ranks' errors and its rank-0 log (as lines), and say its "
             "state; -f follows a live run", "  gptpar logs dp2\n  gptpar logs runs/demo/demo_dp/parallel.dp=2 -n 50\n"
             "  gptpar logs dp2 -f")
    p.add_argument("run", help="run folder, or its name under --runs-dir")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("-n", "--lines", type=_non_negative, default=20)
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep printing rank 0's records as they come, until the run is no longer pending or running")
    p.set_defaults(handler=cmd_logs)

    p = _add(sub, "report", "turn a runs folder into summary.csv, summary.md and figures",
             "  gptpar report\n  gptpar report runs/demo --out figures/demo --include-incomplete\n"
             "  gptpar report runs/tr1\n"
             "  gptpar report runs --group-by parallel.dp_sync --x gpus --format pdf\n"
             "  gptpar report runs --x parallel.bucket_mb --group-by sweep,gpus --dpi 200")
    p.add_argument("runs_dir", nargs="?", default="runs",
                   help="folder of run folders, or one run's folder (default: runs)")
    p.add_argument("--out", default="figures", help="output folder (default: figures)")
    p.add_argument("--warmup-epochs", type=_non_negative, default=1,
                   help="leading epochs dropped when more remain (default: 1)")
    p.add_argument("--warmup-steps", type=_non_negative, default=5,
                   help="leading steps dropped from a run with too few epochs (default: 5)")
    p.add_argument("--include-incomplete", action="store_true",
                   help="also tabulate and plot running, requeued and failed runs")
    p.add_argument("--include-running", action="store_true",
                   help="list runs still pending or running in summary.csv and summary.md (left out and counted "
                        "by default); runs folders nested in RUNS_DIR (runs/demo) are always left to their own "
                        "report")
    p.add_argument("--peak-flops", type=_positive_number, default=None, metavar="FLOPS",
                   help="peak FLOP/s per device for devices the MFU table lacks, e.g. a CPU: 2.5e11 (never guessed)")
    p.add_argument("--group-by", action="append", default=[], metavar="KEY",
                   help="draw one line per value of these keys (repeat or comma-separate; config keys such as "
                        "parallel.dp_sync, or sweep, gpus); default: the sweep and the keys it varies, other than "
                        "the x key and keys that do not change the measurement (max_steps, eval, log, launch.repeat)")
    p.add_argument("--x", metavar="KEY", help="x axis of the time, throughput and speedup figures (a config key, "
                                              "or gpus); default: the GPU count (pipelines: micro-batches, in their "
                                              "own figure)")
    p.add_argument("--target-loss", type=_positive_number, default=None, metavar="LOSS",
                   help="time every run to this validation loss (train loss without evaluation); default: each "
                        "sweep's report.target_loss, else the highest final loss of its runs")
    p.add_argument("--format", default="png", metavar="FORMAT", help="figure format: png, pdf or svg (default: png)")
    p.add_argument("--dpi", type=int, default=110, help="dots per inch of the figures (default: 110)")
    p.set_defaults(handler=cmd_report)

    p = _add(sub, "schedule", "show a pipeline schedule: each rank's actions simulated with F/B/W costs, the "
             "idle share beside the closed form, peak activations, and a Gantt chart with --out",
             "  gptpar schedule show 1f1b --pp 4 --chunks 8\n"
             "  gptpar schedule show interleaved_1f1b --pp 4 --chunks 8 --virtual 2 --out interleaved.png\n"
             "  gptpar schedule show zb1p --pp 4 --chunks 8 --cost-b 1.5 --cost-w 0.5")
    p.add_argument("action", choices=("show",))
    p.add_argument("name", metavar="SCHEDULE", help=either(list(SCHEDULES)))
    p.add_argument("--pp", type=_positive, default=4, help="pipeline ranks P (default: 4)")
    p.add_argument("--chunks", type=_positive, default=8, help="micro-batches per step m (default: 8)")
    p.add_argument("--virtual", type=_positive, default=1, help="stages per rank V, for interleaved_1f1b")
    p.add_argument("--cost-f", type=_positive_number, default=1.0, help="forward cost (default: 1)")
    p.add_argument("--cost-b", type=_positive_number, default=1.0, help="input-gradient backward cost (default: 1)")
    p.add_argument("--cost-w", type=_positive_number, default=1.0, help="weight-gradient backward cost (default: 1)")
    p.add_argument("--out", help="write a Gantt chart (PNG, PDF or SVG by the file's suffix)")
    p.set_defaults(handler=cmd_schedule)

    p = _add(sub, "plan", "predict a layout's step time, memory and cost before submitting: calibrate this device, "
             "predict one layout, or search every layout of N GPUs",
             "  gptpar plan calibrate --out calib.json\n"
             "  gptpar plan predict parallel.dp=2 parallel.dp_sync=zero2 --calibration calib.json\n"
             "  gptpar plan predict my.yaml parallel.pp=2 parallel.pp_schedule=zb1p --calibration calib.json --json\n"
             "  gptpar plan search --model gpt2-xl --gpus 64 --profile bridges2 --calibration h100.json --top 5 "
             "--sweep top.yaml")
    p.add_argument("action", choices=("calibrate", "predict", "search"))
    p.add_argument("words", nargs="*", metavar=CONFIG_ARGS)
    p.add_argument("--calibration", metavar="FILE", help="predict/search: a calibration file (default: the shipped "
                                                           "one of the layout's device)")
    p.add_argument("--json", action="store_true", help="predict: one JSON object")
    p.add_argument("--steps", type=_positive, default=None,
                   help="predict: steps to cost (default: train.max_steps, else 1000)")
    p.add_argument("--out", default="calibration.json", help="calibrate: file to write (default: calibration.json)")
    p.add_argument("--quick", action="store_true", help="calibrate: two shapes and three sizes (a test's minute)")
    p.add_argument("--world", type=_non_negative, default=0,
                   help="calibrate: ranks (default: 2 on a CPU, every GPU up to 8 on CUDA)")
    p.add_argument("--threads", type=_non_negative, default=0, help="calibrate: torch threads per rank (0: default)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16", "tf32"), default="auto",
                   help="calibrate: the precision timed (auto: bf16 or fp16 on a GPU, fp32 on a CPU)")
    p.add_argument("--model", metavar="PRESET", help="search: model.preset")
    p.add_argument("--gpus", type=_positive, help="search: GPUs in all")
    p.add_argument("--profile", help="search: launch.profile (its links and GPU memory)")
    p.add_argument("--top", type=_positive, default=10, help="search: layouts shown (default: 10)")
    p.add_argument("--sweep", metavar="FILE", help="search: write the top layouts as a sweep file for gptpar sweep")
    p.set_defaults(handler=cmd_plan)

    p = _add(sub, "checkpoint", "export a run's checkpoint (torch.distributed.checkpoint, sharded-ready) as "
             "one plain torch.save file; a LoRA run's (train.lora_rank > 0) as peft's adapter folder, or with "
             "--merge the merged model's save_pretrained folder", "  gptpar checkpoint export dp2\n"
             "  gptpar checkpoint export runs/dp2 --out dp2.pt\n  gptpar checkpoint export lora --merge")
    p.add_argument("action", choices=("export",))
    p.add_argument("run", help="run folder, or its name under --runs-dir")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--out", help="file (a LoRA run's: folder) to write (default: RUN/checkpoint.pt; a LoRA run's "
                   "RUN/adapter, with --merge RUN/merged)")
    p.add_argument("--merge", action="store_true", help="a LoRA run: its adapters merged into the model's weights, "
                   "a folder transformers' from_pretrained loads")
    p.set_defaults(handler=cmd_checkpoint)

    p = _add(sub, "trace", "break a run's profiled steps (train.profile_steps) down per rank: compute, "
             "communication, communication overlapped with compute, idle, and the top ops by self time; on GPU "
             "traces beside Holistic Trace Analysis's breakdown and overlap, and where the two disagree",
             "  gptpar trace dp2\n  gptpar trace runs/dp2 --top 20\n  gptpar trace dp2 --json")
    p.add_argument("run", help="run folder, or its name under --runs-dir")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("--top", type=_non_negative, default=10, help="ops listed per rank (default: 10)")
    p.add_argument("--json", action="store_true", help="one JSON object per rank, one a line")
    p.set_defaults(handler=cmd_trace)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Options may stand anywhere among the config words (`submit dp my.yaml --gpus 2 train.lr=1e-3`):
    argparse leaves positionals after an option unmatched, so they are appended to the words here."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    dest = next((d for d in ("words", "overrides") if hasattr(args, d)), None)
    options = [word for word in extra if word.startswith("-")]
    if options or (extra and dest is None):
        command = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        command.error(f"unrecognized arguments: {' '.join(options or extra)}")  # not the config words beside them
    if extra:
        setattr(args, dest, [*getattr(args, dest), *extra])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        code = args.handler(args)
        sys.stdout.flush()  # here, where a reader that went away is caught, not in Python's own flush at exit
        return code
    except GptparError as exc:
        print(f"gptpar: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gptpar: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`gptpar status | head -3`): stop quietly with the status of a process
        # killed by SIGPIPE. What is still buffered goes to /dev/null, so that the flush at exit does not fail again
        # (as Python's documentation of SIGPIPE advises).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
