"""Render the sbatch script of a job (or job array) from templates/job.sbatch.

The header holds only validated plain tokens (see profiles.SAFE_TOKEN and safe_path) because
#SBATCH lines are comments that quoting cannot protect; every value in the script body goes
through shlex.quote. So a hostile run name or path cannot run anything (tests/launch/test_launch.py).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from gptpar.errors import GptparError
from gptpar.launch.prepare import Point, rank_command
from gptpar.launch.profiles import JobSpec, guarded_setup
from gptpar.run.names import slug

TEMPLATE = Path(__file__).with_name("templates") / "job.sbatch"
SAFE_PATH = re.compile(r"[A-Za-z0-9_./+,=@-]+")
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def safe_path(key: str, path: Path) -> str:
    """A path usable in an #SBATCH line; anything else is refused rather than escaped."""
    text = str(path)
    if not SAFE_PATH.fullmatch(text):
        raise GptparError(f"{key}: path {text!r} may hold only letters, digits and _ . / + , = @ - "
                          "(it appears in an #SBATCH line)")
    return text


def header_lines(spec: JobSpec, array: str = "") -> list[str]:
    """The #SBATCH lines that define the job's shape (shared by the jobs of one array)."""
    opts = [("--partition", spec.partition), ("--account", spec.account), ("--qos", spec.qos),
            ("--constraint", spec.constraint), ("--nodes", str(spec.nodes)),
            ("--ntasks-per-node", str(spec.tasks_per_node)), ("--cpus-per-task", str(spec.cpus_per_task)),
            ("--time", spec.time), ("--array", array)]
    lines = [f"#SBATCH {flag}={value}" for flag, value in opts if value]
    if spec.gpu_directive:
        lines.append(f"#SBATCH {spec.gpu_directive}")
    return lines


def render(spec: JobSpec, name: str, run_dirs: Sequence[Path], command: Sequence[str], output_dir: Path,
           max_concurrent: int = 0) -> str:
    """The exact script `sbatch` receives; an array of len(run_dirs) > 1 with a concurrency limit."""
    if not run_dirs:
        raise GptparError("nothing to render: no run folders")
    array = f"0-{len(run_dirs) - 1}%{max_concurrent}" if len(run_dirs) > 1 else ""
    pattern = "%A_%a.out" if array else "%j.out"
    values = {
        "kind_command": f"submit {spec.kind}" if not array else f"sweep ({spec.kind})",
        "profile": slug(spec.profile),  # a comment line: only safe characters may reach it
        "job_name": slug(name, 64),
        "header": "\n".join(header_lines(spec, array)),
        "output": f"{safe_path('log.runs_dir', output_dir)}/sbatch-{pattern}",
        "signal_s": str(spec.signal_s),
        "setup": "\n".join(guarded_setup(spec.setup)),
        "run_dirs": " ".join(shlex.quote(str(d)) for d in run_dirs),
        "nodes": str(spec.nodes),
        "tasks_per_node": str(spec.tasks_per_node),
        "command": shlex.join(command),
    }
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], TEMPLATE.read_text())


def render_script(points: Sequence[Point], spec: JobSpec, name: str, output_dir: Path) -> str:
    """The script of one job running `points` (an array when there are several)."""
    cfg = points[0].cfg
    return render(spec, name, [p.folder.path for p in points], rank_command(cfg), output_dir,
                  cfg.launch.max_concurrent)
