"""data.task=sft: question/response pairs (MetaMathQA's schema, the bundled sample), the loss on response tokens
only, and the final answer's exact-match accuracy at each epoch end.

The pair machinery is translation's (tests/data/test_translation.py holds its equality under every layout); here: the
fields read and refused, the template's masks, the answer extraction with known answers, the trainer's score of known
decoded responses against their own references, and a whole run that logs answer_accuracy in its epoch record and learns
to state the answers of the bundled problems' easiest kind.
The llama family trains sft under data parallelism, the pipeline and tensor parallelism like one process in
tests/model/test_architectures.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rank_training import make_config, make_trainer

from analysis.answers import answers_section
from gptpar.config import ConfigError, DataConfig, LogConfig, load_config
from gptpar.data.pair_files import read_pairs
from gptpar.data.pairs import IGNORE, load_pairs
from gptpar.errors import GptparError
from gptpar.parallel.process_group import RankInfo
from gptpar.run.logfile import Answer, answers_path, format_record, read_answers, read_rank_log, write_answers
from gptpar.train.bleu import answer_accuracy, final_answer
from gptpar.train.entry import run_rank
from gptpar.train.progress import Progress
from gptpar.train.trainer import Trainer

SFT = ["data.task=sft", "data.source=metamath_sample", "data.tokenizer=bytes", "data.max_source_len=116",
       "data.max_target_len=120"]
SINGLE = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0,
                  launcher="single", backend="gloo", device=torch.device("cpu"))


@pytest.mark.parametrize(("text", "answer"), [
    ("Sam spends 66 + 18 = $84.\nThe answer is: 84", "84"),
    ("The answer is: 3\nwait, The answer is: 1,200.", "1200"),  # the last statement, separators and period dropped
    ("first line\n  42  \n", "42"),  # no statement: the last non-empty line
    ("the answer is 7", "7"),
    ("", ""),
])
def test_the_final_answer_is_what_the_last_statement_says(text: str, answer: str) -> None:
    assert final_answer(text) == answer


def test_answer_accuracy_is_the_share_of_matching_final_answers() -> None:
    references = ["x = 4.\nThe answer is: 4", "The answer is: 12", "The answer is: 7", "so 9\nThe answer is: 9"]
    responses = ["The answer is: 4", "The answer is: 13", "7", "The answer is: 9."]
    assert answer_accuracy(responses, references) == 0.75
    assert answer_accuracy([], []) == 0.0


def _write_pairs(path: Path, pairs: list[tuple[str, str]]) -> str:
    path.write_text("".join(json.dumps({"query": query, "response": response}) + "\n" for query, response in pairs))
    return str(path)


def test_the_trainers_answer_accuracy_scores_each_response_against_its_own_reference(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The epoch record's score as the trainer forms it (`Trainer.scoring.scores`), on responses known in advance: a
    first trainer decodes the validation prompts; a second, the same model (same seed, same byte vocabulary) on the same
    prompts, gets references that state the response's own final answer for samples 0, 1 and 3 and another answer
    for 2 (and for the two pairs past train.answer_samples=4). It decodes the same responses and scores exactly 0.75:
    scoring the responses against themselves gives 1.0, against another row's reference less. An initialised model
    answers every prompt alike (12 × "!"); its weights scaled by 5 make each answer its own. Scored as an epoch's
    end, the answers are kept in the run folder (prompt, response, reference, correct) and decoding shows progress."""
    train = _write_pairs(tmp_path / "train.jsonl", [(f"What is {i} + {i}?", f"{i} + {i} = {2 * i}\nThe answer is: "
                                                    f"{2 * i}") for i in range(16)])
    questions = [f"How many legs do {n} spiders have?" for n in range(2, 8)]
    base = [*SFT, "data.max_source_len=40", "data.max_target_len=12", "model.preset=qwen2-tiny", "model.n_layer=2",
            "model.n_embd=32", "model.n_head=2", "train.batch_size=8", "train.answer_samples=4", "train.threads=1"]

    def trainer(name: str, references: list[str]) -> Trainer:
        val = _write_pairs(tmp_path / f"{name}.jsonl", list(zip(questions, references, strict=True)))
        made = make_trainer(make_config([*base, f"data.source=jsonl:{train},{val}"], tmp_path, name), SINGLE)
        with torch.no_grad():
            for param in made.net.parameters():
                param.mul_(5)
        return made

    first = trainer("first", ["The answer is: 0"] * 6)
    (responses,) = first.scoring.translate(4, [first.pairs.val])
    other = [f"The answer is: {final_answer(r)}7" for r in responses]  # never the response's own final answer
    second = trainer("second", [responses[0], responses[1], other[2], responses[3], other[3], other[3]])
    assert second.scoring.translate(4, [second.pairs.val]) == [responses]  # the same model decodes the same texts
    assert second.scoring.scores() == {"answer_accuracy": 0.75}
    assert not (tmp_path / "second" / "answers").exists()  # no epoch given: nothing kept

    # ISSUE 48.4: at an epoch's end rank 0 keeps the decoded answers and shows its progress on the progress channel.
    second.scoring.progress = Progress(LogConfig(progress="lines"), rank=0, ranks=1, total=1, start=0)
    capsys.readouterr()
    assert second.scoring.scores(3) == {"answer_accuracy": 0.75}
    assert "decoding for answers: 4/4 prompts" in capsys.readouterr().out
    kept = read_answers(tmp_path / "second")
    assert list(kept) == [3] and [a.response for a in kept[3]] == responses
    assert [a.correct for a in kept[3]] == [True, True, False, True]
    assert [a.reference for a in kept[3]] == [responses[0], responses[1], other[2], responses[3]]
    assert all(f"How many legs do {n} spiders have?" in a.prompt for a, n in zip(kept[3], range(2, 6), strict=True))


def test_an_epochs_answers_are_written_once_and_never_overwritten(tmp_path: Path) -> None:
    """A resumed start that scores a completed epoch again keeps its file; later epochs add files; no temporary
    file is left beside them."""
    first = [Answer("Q: 2+2?", "The answer is: 4", "The answer is: 4", correct=True)]
    again = [Answer("Q: 2+2?", "The answer is: 5", "The answer is: 4", correct=False)]
    assert write_answers(tmp_path, 0, first) and not write_answers(tmp_path, 0, again)
    assert write_answers(tmp_path, 1, again)
    assert read_answers(tmp_path) == {0: first, 1: again}
    assert sorted(p.name for p in answers_path(tmp_path, 0).parent.iterdir()) == ["epoch0.jsonl", "epoch1.jsonl"]


def test_the_report_shows_a_few_answers_of_the_last_epoch(tmp_path: Path) -> None:
    rows = [Answer(f"Question {i} | with a bar", f"The answer is: {i}", "The answer is: 1", correct=i == 1)
            for i in range(5)]
    write_answers(tmp_path / "sft", 0, rows[:1])
    write_answers(tmp_path / "sft", 1, rows)
    lines = answers_section([("sft", tmp_path / "sft"), ("lm", tmp_path / "lm")], shown=2)
    assert lines[-3:] == ["|---|---|---|---|---|---|",
                          "| sft | 1 | Question 0 / with a bar | The answer is: 0 | The answer is: 1 | no |",
                          "| sft | 1 | Question 1 / with a bar | The answer is: 1 | The answer is: 1 | yes |"]
    assert answers_section([("lm", tmp_path / "lm")]) == []
    write_answers(tmp_path / "untrained", 0, [Answer("Q", " \n", "The answer is: 1", correct=False)])
    shown_empty = answers_section([("untrained", tmp_path / "untrained")])[-1]
    assert shown_empty == "| untrained | 0 | Q | (empty) | The answer is: 1 | no |"


def test_the_bundled_sample_is_metamathqa_shaped_and_held_out_by_position() -> None:
    splits = read_pairs(DataConfig(task="sft", source="metamath_sample"))
    assert (len(splits.train), len(splits.val), splits.test) == (288, 32, None)
    assert all(response.rstrip().splitlines()[-1].startswith("The answer is: ") for _, response in splits.train)
    assert len({query for query, _ in splits.train + splits.val}) == 320  # no question twice


def test_fields_are_configurable_and_a_missing_one_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"The answer is: {i}"}) + "\n"
                            for i in range(10)))
    cfg = DataConfig(task="sft", source=f"jsonl:{path}", prompt_field="question", response_field="answer")
    assert read_pairs(cfg).train[0] == ("q0", "The answer is: 0")
    with pytest.raises(GptparError) as error:
        read_pairs(DataConfig(task="sft", source=f"jsonl:{path}"))  # MetaMathQA's query/response by default
    assert str(error.value) == (f"data.source=jsonl: {path}:1: expected an object with 'query' and 'response' "
                                "strings, 'query' is missing or not a string; got {'question': 'q0', 'answer': "
                                "'The answer is: 0'}")


def test_the_loss_counts_response_tokens_and_the_end_only() -> None:
    data = load_pairs(load_config(None, SFT).data)
    x, y = data.train[0]
    prompt, response = data.train.prompts[0].tolist(), data.train.responses[0].tolist()
    sep, eos = data.tokenizer.vocab_size, data.tokenizer.vocab_size + 1
    assert prompt[-1] == sep and response[-1] == eos == data.eos  # the plain template: prompt <sep> response <eos>
    assert x.tolist() == [*prompt, *response[:-1]]
    assert y.tolist() == [IGNORE] * (len(prompt) - 1) + response
    assert data.text(response) == data.train.references[0]


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.task=sft"], "data.task=sft reads question/response pairs: data.source='stdlib' is not allowed; use "
                        "metamath_sample (bundled), jsonl:TRAIN[,VALID[,TEST]] or hf:NAME (e.g. "
                        "hf:meta-math/MetaMathQA)"),
    (["data.task=sft", "data.source=tsv:x.tsv"], "data.source='tsv:x.tsv' is not allowed"),
    ([*SFT, "model.init=pretrained", "model.preset=gpt2"], "data.task=sft adds two tokens (<sep>, <eos>)"),
])
def test_config_refuses_what_sft_cannot_train(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow  # the data loader's workers
def test_a_run_logs_answer_accuracy_each_epoch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The whole run (`gptpar train`'s code) on qwen2-tiny: every epoch record carries answer_accuracy, a share in
    [0, 1] of train.answer_samples decoded prompts, shown in the progress line and by `gptpar logs`; decoding shows its
    progress, and each epoch's answers are kept in the run folder."""
    cfg = load_config(None, [*SFT, "model.preset=qwen2-tiny", "model.n_layer=2", "model.n_embd=64",
                             "train.batch_size=16", "train.epochs=2", "train.eval_every=0", "train.answer_samples=4",
                             "train.threads=1", "log.progress=lines", f"log.runs_dir={tmp_path}", "log.run_id=sft"])
    run_rank(cfg)
    log = read_rank_log(tmp_path / "sft" / "rank0.jsonl")
    scores = [log.epochs[e]["answer_accuracy"] for e in sorted(log.epochs)]
    assert len(scores) == 2 and all(s in (0.0, 0.25, 0.5, 0.75, 1.0) for s in scores)
    shown = f"answer_accuracy {scores[-1]:.2f}"
    out = capsys.readouterr().out
    assert shown in out and format_record(log.epochs[1]).endswith(shown)
    assert out.count("decoding for answers: 4/4 prompts") == 2
    answers = read_answers(tmp_path / "sft")  # each epoch's, their share correct its score
    assert list(answers) == [0, 1] and all(len(rows) == 4 for rows in answers.values())
    assert [sum(a.correct for a in answers[e]) / 4 for e in (0, 1)] == scores
