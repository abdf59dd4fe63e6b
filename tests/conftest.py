"""Shared fixtures: an isolated data cache per test session, and the shared corpus when present."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the session, so the corpus is tokenized once across tests."""
    return tmp_path_factory.mktemp("gptpar-data")


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> None:
    """Keep tests off the network and off the user's caches and defaults; never inherit a surrounding job."""
    monkeypatch.setenv("GPTPAR_DATA_DIR", str(data_dir))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("GPTPAR_USER_CONFIG", str(data_dir / "no-user-defaults.yaml"))  # not the tester's own
    for key in list(os.environ):
        if key.startswith(("SLURM_", "SBATCH_")) or key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "GPTPAR_PROFILE", "GPTPAR_ACCOUNT",
                                                             "NERSC_HOST"):
            monkeypatch.delenv(key)


@pytest.fixture
def shakespeare_dir() -> Path:
    if not (SHARED_DATA / "tinyshakespeare.txt").is_file():
        pytest.skip("../shared/data/tinyshakespeare.txt is not present")
    return SHARED_DATA
