"""Data before the job (gptpar.data.fetch): on a machine that cannot reach the Hugging Face hub (this one), a hub
dataset missing from the cache is refused before any run folder is written, naming `gptpar data fetch`, and the fetch
itself fails in one line; a local source has nothing to fetch. (Fetching for real needs the hub: not run here.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from gptpar import cli
from gptpar.config import load_config
from gptpar.errors import GptparError
from gptpar.launch.prepare import prepare_run

MISSING = "hf:nobody-gptpar/not-cached"


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as a compute node sees it, at once (no probe to wait for)


def test_an_uncached_hub_dataset_offline_is_one_line_before_any_run_folder(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    cfg = load_config(None, [f"data.source={MISSING}", "data.task=translation", f"log.runs_dir={tmp_path / 'runs'}"])
    with pytest.raises(GptparError) as error:
        prepare_run(cfg)
    assert str(error.value) == (f"data.source={MISSING}: not in this machine's Hugging Face cache and the hub is "
                                f"unreachable; run `gptpar data fetch {MISSING}` where the hub is reachable (a login "
                                "node), then again here")
    assert not (tmp_path / "runs").exists()


def test_data_fetch_says_what_it_can_and_cannot_fetch_in_one_line(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["data", "fetch", MISSING]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"gptpar: error: data.source={MISSING}: the Hugging Face hub is unreachable from this "
                              "machine (within data.hub_timeout_s=3 s); fetch where it is reachable\n")
    assert cli.main(["data", "fetch", "stdlib"]) == 0
    assert capsys.readouterr().out == "nothing to fetch: data.source=stdlib is read from this machine's files\n"
