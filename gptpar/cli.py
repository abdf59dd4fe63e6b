"""`gptpar`: train, show the config, submit jobs and sweeps, watch them, and report on them."""

from __future__ import annotations

import argparse
import sys

from gptpar.config import load_config, reference_markdown, split_config_args, to_yaml
from gptpar.errors import GptparError


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config file (optional)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")


def cmd_train(args: argparse.Namespace) -> int:
    from gptpar.preemption import install_preemption_handler

    install_preemption_handler()  # before torch is imported: a job's USR2 may come early
    from gptpar.trainer import run_training

    path, overrides = split_config_args([args.config, *args.overrides] if args.config else [])
    result = run_training(load_config(path, overrides))
    return 0 if result["status"] in ("completed", "requeued") else 1


def cmd_config(args: argparse.Namespace) -> int:
    if args.action == "reference":
        print(reference_markdown())
        return 0
    path, overrides = split_config_args([args.config, *args.overrides] if args.config else [])
    print(to_yaml(load_config(path, overrides)), end="")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from analysis.report import main as report_main

    return report_main(args.report_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gptpar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train GPT-2 (spawns parallel.dp local ranks outside SLURM/torchrun)")
    _add_config_args(train)
    train.set_defaults(handler=cmd_train)

    config = sub.add_parser("config", help="print the resolved config, or the reference of every key")
    config.add_argument("action", choices=("show", "reference"))
    _add_config_args(config)
    config.set_defaults(handler=cmd_config)

    report = sub.add_parser("report", help="turn runs/ into figures/ and a summary table", add_help=False)
    report.add_argument("report_args", nargs=argparse.REMAINDER)
    report.set_defaults(handler=cmd_report)

    from gptpar.launch.commands import register

    register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except GptparError as exc:
        print(f"gptpar: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gptpar: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
