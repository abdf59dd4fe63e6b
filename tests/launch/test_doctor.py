"""`gptpar doctor` runs every check and exits 0 with findings, 1 only when the install is broken."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

from gptpar import doctor
from gptpar.cli import main


@pytest.mark.slow
def test_doctor_on_this_machine_runs_every_check_and_exits_0() -> None:
    out = subprocess.run([sys.executable, "-m", "gptpar", "doctor"], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    names = {line.split()[1] for line in lines[:-1]}
    assert {*doctor.REQUIRED, "gptpar", "SLURM", "profile", "space:"} <= names
    assert lines[-1].endswith("0 broken")


@pytest.mark.slow  # the doctor asks sinfo wherever a SLURM client is installed (CI's cluster)
def test_a_package_that_does_not_import_is_broken_and_exits_1(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(doctor, "REQUIRED", (*doctor.REQUIRED, "gptpar_no_such_package"))
    monkeypatch.setattr(doctor, "LOW_SPACE_BYTES", 2**62)  # every disk is "low": findings, still exit 1 for broken
    assert main(["doctor", "launch.profile=bridges2"]) == 1
    out = capsys.readouterr().out
    assert "broken   gptpar_no_such_package" in out and "run make install" in out
    assert "finding  space: runs" in out
    assert "finding  account" in out  # a billed cluster's profile without launch.account


@pytest.mark.parametrize(("capability", "arch_list", "fine"), [
    ((7, 0), ["sm_80", "sm_90"], False),  # a V100 and a wheel without sm_70
    ((7, 0), ["sm_70", "sm_80"], True),
    ((8, 6), ["sm_80", "compute_80"], True),  # PTX the driver compiles for sm_86
    ((7, 0), ["sm_80", "compute_80"], False),  # PTX for a newer architecture does not run on an older one
])
def test_gpu_architecture_against_the_wheel(capability: tuple[int, int], arch_list: list[str], fine: bool) -> None:
    finding = doctor.arch_finding(capability, arch_list)
    assert (finding is None) == fine
    if finding:
        assert f"sm_{capability[0]}{capability[1]}" in finding


def test_optional_packages_are_listed_with_their_feature_and_missing_ones_are_findings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    installed = {"datasets", "tensorboard"}
    monkeypatch.setattr(doctor.importlib.util, "find_spec", lambda name: object() if name in installed else None)
    checks = {c.name: c for c in doctor._optional()}
    assert list(checks) == ["datasets", "sacrebleu", "tensorboard", "wandb"]
    assert checks["datasets"].status == "ok" and "data.source=hf:" in checks["datasets"].detail
    assert checks["sacrebleu"].status == "finding"
    assert checks["sacrebleu"].detail == ("missing (optional): needed for BLEU of data.task=translation; "
                                          "pip install 'gptpar[translation]' or make install")
    assert checks["wandb"].status == "finding" and "log.wandb" in checks["wandb"].detail
