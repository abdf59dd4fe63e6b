"""The launch subcommands of the gptpar CLI: submit, sweep, status, logs."""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from gptpar.config import load_config, split_config_args
from gptpar.errors import GptparError
from gptpar.launch.runs import STATES, find_runs, job_dir, last_step, run_state
from gptpar.logs import rank_log_path


def _submit_options() -> argparse.ArgumentParser:
    """Options of `submit`, parsed from anywhere among the overrides (argparse alone cannot)."""
    p = argparse.ArgumentParser(prog="gptpar submit KIND", add_help=False)
    p.add_argument("--gpus", type=int, help="GPUs per node (launch.gpus); DP runs one task per GPU")
    p.add_argument("--nodes", type=int, help="nodes (launch.nodes)")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script and submit nothing")
    return p


def cmd_submit(args: argparse.Namespace) -> int:
    from gptpar.launch.submit import submit

    opts, words = _submit_options().parse_known_args(args.words)
    unknown = [w for w in words if w.startswith("-")]
    if unknown:
        raise GptparError(f"submit: unknown option {unknown[0]!r}; options: --gpus N, --nodes M, --dry-run")
    path, overrides = split_config_args(words)
    if opts.gpus is not None:
        overrides.append(f"launch.gpus={opts.gpus}")
    if opts.nodes is not None:
        overrides.append(f"launch.nodes={opts.nodes}")
    return submit(load_config(path, overrides), args.kind, dry_run=opts.dry_run)


def cmd_sweep(args: argparse.Namespace) -> int:
    from gptpar.launch.sweep import run_sweep

    return run_sweep(args.file, dry_run=args.dry_run, runs_dir=args.runs_dir or "", overrides=args.overrides,
                     wait=args.wait)


def cmd_status(args: argparse.Namespace) -> int:
    root = Path(args.runs_dir)
    if not root.is_dir():
        raise GptparError(f"runs folder {str(root)!r} does not exist")
    by_state: dict[str, list[Path]] = defaultdict(list)
    for run in find_runs(root):
        by_state[run_state(run)].append(run)
    for state in STATES:
        for run in by_state.get(state, []):
            print(f"{state:<10} {str(run.relative_to(root)):<50} step {last_step(run)}")
    counts = ", ".join(f"{len(by_state[s])} {s}" for s in STATES if by_state.get(s))
    print(f"{sum(map(len, by_state.values()))} run(s): {counts or 'none'}")
    return 0


def _tail(path: Path, lines: int) -> None:
    text = path.read_text(errors="replace").splitlines()
    print(f"==> {path} <==")
    print("\n".join(text[-lines:]))


def cmd_logs(args: argparse.Namespace) -> int:
    run = Path(args.run)
    if not run.is_dir():
        run = Path(args.runs_dir) / args.run
    if not run.is_dir():
        raise GptparError(f"run {args.run!r} not found (as a path or under {args.runs_dir})")
    files = sorted(p for p in job_dir(run).glob("*") if p.suffix in (".out", ".err") and p.stat().st_size)
    files.append(rank_log_path(run, 0))
    for path in files:
        if path.is_file():
            _tail(path, args.lines)
    print(f"state: {run_state(run)}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add submit, sweep, status and logs to the gptpar CLI."""
    p = subparsers.add_parser("submit", help="submit a dp or pp run (SLURM when reachable, else local processes)",
                              epilog=_submit_options().format_help())
    p.add_argument("kind", choices=("dp", "pp"))
    p.add_argument("words", nargs=argparse.REMAINDER, metavar="[--gpus N] [--nodes M] [--dry-run] "
                   "[CONFIG.yaml] [section.key=value ...]")
    p.set_defaults(handler=cmd_submit)

    p = subparsers.add_parser("sweep", help="submit every point of a sweep file not yet done")
    p.add_argument("file")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="applied to every point's base")
    p.add_argument("--dry-run", action="store_true", help="print the points and scripts only")
    p.add_argument("--wait", action="store_true", help="on SLURM, return once every point has finished")
    p.add_argument("--runs-dir", help="override log.runs_dir of the sweep's points")
    p.set_defaults(handler=cmd_sweep)

    p = subparsers.add_parser("status", help="list runs by state (pending, running, completed, failed, ...)")
    p.add_argument("runs_dir", nargs="?", default="runs")
    p.set_defaults(handler=cmd_status)

    p = subparsers.add_parser("logs", help="tail a run's job output and rank-0 log")
    p.add_argument("run", help="run folder, or its name under --runs-dir")
    p.add_argument("--runs-dir", default="runs")
    p.add_argument("-n", "--lines", type=int, default=20)
    p.set_defaults(handler=cmd_logs)
