"""A device's calibration: what `gptpar plan calibrate` measured, and the lookups the cost model asks of it.

A calibration is plain JSON, so a file made on a GPU node can travel to a login node and be read without torch. It
holds measured points, not a fitted model: compute as (FLOPs, seconds) per kind of action (a block's forward F, its
input-gradient backward B and weight-gradient backward W; the embedding with the final norm, head and loss forward
and backward; the optimizer per parameter), the bytes one block saves for backward per token, and collectives as
(bytes, seconds) per operation over `world_size` ranks. Lookups interpolate the achieved rate over log FLOPs (a small
matmul runs slower per FLOP than a large one) and hold it flat past the measured ends; collectives are fitted as
latency + ring share / bandwidth (gptpar.parallel.comm's ring terms), so they can be priced for other group sizes.
"""

from __future__ import annotations

import bisect
import json
import math
import platform
from dataclasses import asdict, dataclass, field, fields
from importlib import metadata
from pathlib import Path
from typing import Any

from gptpar.errors import GptparError
from gptpar.paths import check_path
from gptpar.strategies.collectives import ring_share, ring_steps

FORMAT = 1
SHIPPED_DIR = Path(__file__).with_name("calibrations")
COMPUTE_KINDS = ("block_f", "block_b", "block_w", "head_f", "head_bw", "optimizer")
# A block under train.activation_checkpointing, timed whole: F keeps only its input, B runs F again first.
RECOMPUTED = ("recomputed_f", "recomputed_b", "recomputed_w")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send_recv")
CALIBRATION_FLAG = "--calibration"  # where a calibration is named: the plan commands' flag, or a config key


def calibrate_hint(key: str = CALIBRATION_FLAG) -> str:
    """How to make the calibration `key` should name."""
    name = f"pass {key} FILE" if key.startswith("--") else f"set {key}=FILE"
    return f"run `python -m gptpar plan calibrate --out FILE` on that device and {name}"


@dataclass(frozen=True)
class LinkFit:
    """A link as the cost model sees it: each ring step costs `latency_s`, each byte on the wire 1 / `bandwidth`."""

    latency_s: float
    bandwidth: float  # bytes/s one rank sends
    source: str = ""

    def seconds(self, op: str, nbytes: float, size: int) -> float:
        """One `op` of `nbytes` over `size` ranks; a send is one step of its whole payload."""
        if op == "send_recv":
            return self.latency_s + nbytes / self.bandwidth
        if size < 2:
            return 0.0
        return ring_steps(op, size) * self.latency_s + ring_share(op, nbytes, size) / self.bandwidth


def _fit(points: list[tuple[float, float]], op: str, size: int) -> LinkFit:
    """Least squares of seconds = steps * latency + share / bandwidth over the measured sizes (latency and
    bandwidth kept positive)."""
    xs = [float(b) if op == "send_recv" else ring_share(op, b, size) for b, _ in points]
    ys = [s for _, s in points]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    slope = max(slope, 1e-15)
    intercept = max(my - slope * mx, min(ys) * 0.01 if n else 0.0, 1e-7)
    steps = 1 if op == "send_recv" else ring_steps(op, size)
    return LinkFit(intercept / max(steps, 1), 1.0 / slope, "measured by gptpar plan calibrate")


@dataclass(frozen=True)
class Calibration:
    """One device's measurements (see the module's docstring); `source` says where a shipped one came from."""

    device: str  # cpu or cuda
    device_name: str
    backend: str
    precision: str
    torch_version: str
    threads: int
    date: str
    host: str
    world_size: int
    compute: dict[str, list[list[float]]]  # kind -> [[flops (params for the optimizer), seconds], ...] by size
    activation_bytes_per_token_width: float  # bytes one block saves for backward, per token and per unit of width
    collectives: dict[str, list[list[float]]] = field(default_factory=dict)  # op -> [[bytes, seconds], ...]
    source: str = ""
    compute_alone: dict[str, list[list[float]]] = field(default_factory=dict)  # one CPU rank alone on the machine
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def seconds(self, kind: str, flops: float, alone: bool = False) -> float:
        """Seconds of `flops` of action `kind`, at the rate the calibration reached for work of that size (`alone`:
        with no other rank on the machine, where the calibration measured that)."""
        if flops <= 0:
            return 0.0
        points = sorted((self.compute_alone if alone and self.compute_alone.get(kind) else self.compute)[kind])
        xs = [math.log(f) for f, _ in points]
        rates = [f / s for f, s in points]
        x = math.log(flops)
        i = bisect.bisect_left(xs, x)
        if i == 0:
            rate = rates[0]
        elif i == len(xs):
            rate = rates[-1]
        else:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            rate = rates[i - 1] + t * (rates[i] - rates[i - 1])
        return flops / rate

    def link(self, op: str) -> LinkFit | None:
        """The measured link of `op`, None when this calibration measured no collectives (one device)."""
        points = self.collectives.get(op)
        return _fit([(b, s) for b, s in points], op, self.world_size) if points else None


def tp_kind(kind: str, tp: int, sequence_parallel: bool, loss_parallel: bool = False) -> str:
    """The calibration's name of a tensor-parallel action `kind` (block_f, block_b, block_w; head_f, head_bw, which
    loss parallelism changes) timed whole on `tp` ranks, collectives included."""
    return f"{kind}@tp{tp}{'+sp' if sequence_parallel else ''}{'+lp' if loss_parallel else ''}"


def cp_kind(kind: str, cp: int, impl: str) -> str:
    """The calibration's name of a block action `kind` (block_f, block_b, block_w) timed whole on one of `cp` ranks
    of a context-parallel group under parallel.cp_impl=`impl`, its exchanges included."""
    return f"{kind}@cp{cp}+{impl}"


def local_device_name() -> str:
    """This machine's CPU model, read without torch, to match a CPU calibration against the machine it predicts."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def installed_torch() -> str:
    """The installed torch's version, read without importing it."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "none"


def load(path: str | Path, key: str = CALIBRATION_FLAG) -> Calibration:
    """A calibration file, or a one-line error naming what is wrong with it (and `key`, where it was named)."""
    file = check_path(path, "file", key, "name a file written by `gptpar plan calibrate --out FILE`")
    try:
        data: Any = json.loads(file.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        if data.get("format") != FORMAT:
            raise GptparError(f"{key} {str(file)!r} has format {data.get('format')!r}, this gptpar reads "
                              f"{FORMAT}; {calibrate_hint(key)}")
        _check_fields(data)
        calib = Calibration(**data)
        missing = [k for k in COMPUTE_KINDS if not calib.compute.get(k)]
    except (ValueError, TypeError) as exc:
        raise GptparError(f"{key} {str(file)!r} is not a calibration ({str(exc).splitlines()[0]}); "
                          f"{calibrate_hint(key)}") from None
    if missing:
        raise GptparError(f"{key} {str(file)!r} lacks {', '.join(missing)}; {calibrate_hint(key)}")
    return calib


def _check_fields(data: dict[str, Any]) -> None:
    """Each field of the type Calibration declares, and every measured number finite and positive: a negative or
    NaN time would be predicted as a negative or NaN step (ValueError naming the field, for `load` to report)."""
    for f in fields(Calibration):
        if f.name not in data:
            continue  # Calibration(**data) names a missing field; the defaulted ones may be absent
        value, bad = data[f.name], ""
        if f.type == "str" and not isinstance(value, str):
            bad = "a string"
        elif f.type == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            bad = "a whole number >= 1"
        elif f.type == "float" and not _positive(value):
            bad = "a finite number > 0"
        elif f.type.startswith("dict"):
            _check_points(f.name, value)
        if bad:
            raise ValueError(f"{f.name} is {_shown(value)}, not {bad}")


def _check_points(name: str, table: Any) -> None:
    """A table of measured points: kind -> [[size, seconds], ...], each number finite and positive."""
    if not isinstance(table, dict):
        raise ValueError(f"{name} is {_shown(table)}, not an object of [[size, seconds], ...] lists")
    for kind, points in table.items():
        if not isinstance(points, list):
            raise ValueError(f"{name}.{kind} is {_shown(points)}, not a list of [size, seconds] pairs")
        for i, point in enumerate(points):
            if not (isinstance(point, list) and len(point) == 2 and all(map(_positive, point))):
                raise ValueError(f"{name}.{kind}[{i}] is {_shown(point)}, not [size, seconds] with both finite "
                                 "and > 0")


def _shown(value: Any) -> str:
    """A value as the file spells it, cut short: a message stays one readable line."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def shipped() -> dict[str, Path]:
    """The calibrations shipped with gptpar (made on a real device, each saying so in its `source`), by file stem."""
    return {p.stem: p for p in sorted(SHIPPED_DIR.glob("*.json"))}


def same_device(calibrated: str, wanted: str) -> bool:
    """Whether a calibration's device name fits a wanted device (a CPU's model name, or a GPU type such as
    v100-32 against `Tesla V100-SXM2-32GB`): the GPU type's family must appear in the calibrated name."""
    a, b = calibrated.lower().replace("_", " "), wanted.lower().replace("_", " ")
    if a == b:
        return True
    family = b.split("-")[0].split()[0] if b else ""
    return bool(family) and family in a


def check_fits(calib: Calibration, path: str, device: str, torch_version: str | None,
               key: str = CALIBRATION_FLAG) -> None:
    """Refuse a calibration of another device or torch version in one line that says how to make the right one."""
    if not same_device(calib.device_name, device):
        raise GptparError(f"{key} {path!r} was made on {calib.device_name!r}, but this layout runs on "
                          f"{device!r}; {calibrate_hint(key)}")
    if torch_version is not None and calib.torch_version.split("+")[0] != torch_version.split("+")[0]:
        raise GptparError(f"{key} {path!r} was made with torch {calib.torch_version}, but torch "
                          f"{torch_version} is installed; kernels change between versions: {calibrate_hint(key)}")


def find(path: str | None, device: str, local: bool, key: str = CALIBRATION_FLAG) -> tuple[Calibration, str]:
    """The calibration to predict with: the file given (by `key`), else a shipped one of the device; checked against
    the device (and, for this machine, the installed torch). Returns it with the name it is known by."""
    if path:
        calib = load(path, key)
        check_fits(calib, path, device, installed_torch() if local else None, key)
        return calib, path
    for name, file in shipped().items():
        calib = load(file)
        if same_device(calib.device_name, device):
            check_fits(calib, str(file), device, installed_torch() if local else None, key)
            return calib, f"shipped {name} ({calib.source})"
    have = ", ".join(shipped()) or "none yet"
    raise GptparError(f"no calibration for {device!r} (shipped: {have}); {calibrate_hint(key)}")
