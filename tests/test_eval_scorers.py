"""Target scorers on a tiny random Llama and small real-data subsets: values, names, user scorers, errors."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from atlas_core.paths import data_dir
from atlas_core.train import render_chat
from atlas_core.typed_config import ConfigError
from evaluation import tasks
from evaluation.answers import extract_gsm8k_answer, grade_answer, normalize_number
from evaluation.data import gsm8k_pairs, load_gsm8k, load_mbpp_plus, mbpp_pairs
from evaluation.generate import generate
from evaluation.prompts import math_message
from evaluation.scorer_base import ProblemScore, TargetScorer
from evaluation.scorers import SCORERS, build_scorer
from evaluation.scorers_builtin import response_stats
from evaluation.tiny import tiny_llama, tiny_tokenizer

pytestmark = pytest.mark.skipif(not (data_dir() / "gsm8k/test.jsonl").is_file(), reason="data files not available")
HERE = "tests.test_eval_scorers"


@pytest.fixture(scope="module", params=[True, False], ids=["chat", "plain"])
def tiny(request):
    tok = tiny_tokenizer(chat=request.param)
    return tiny_llama(len(tok), seed=0), tok


@pytest.fixture(scope="module")
def chat_tiny():
    tok = tiny_tokenizer(chat=True)
    return tiny_llama(len(tok), seed=0), tok


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ------------------------------------------------------------------------------ scores and aggregates
def test_problem_score_summarise_and_restore() -> None:
    values = {
        "a": ProblemScore("pass", True, 1.0),
        "b": ProblemScore("fail", False, 0.0),
        "c": ProblemScore("x", True, 1.0),
    }
    summed, meaned = TargetScorer(), TargetScorer()
    meaned.aggregate = "mean"
    assert summed.summarise(values) == 2.0 and meaned.summarise(values) == pytest.approx(2 / 3)
    assert summed.summarise({}) == 0.0
    with pytest.raises(ValueError, match="at least one"):
        meaned.summarise({})
    assert summed.restore("fail", False) == ProblemScore("fail", False, 0.0)
    assert meaned.restore("0.879000", True) == ProblemScore("0.879000", True, 0.879)
    with pytest.raises(ValueError, match="answer: expected a string or None"):
        ProblemScore(3, True, 1.0)
    with pytest.raises(ValueError, match="correct: expected true or false"):
        ProblemScore("a", 1, 1.0)
    with pytest.raises(ValueError, match="value: expected a finite number"):
        ProblemScore("a", True, float("nan"))


def test_grade_answer_normalises_whitespace_and_case() -> None:
    assert grade_answer("exact", "  The\n Cat  ", "the cat") == ("the cat", True)
    assert grade_answer("exact", "the cats", "the cat") == ("the cats", False)
    assert grade_answer("number", "so it is 3. The answer is 1,200.", "1200") == ("1200", True)
    with pytest.raises(ValueError, match="checker"):
        grade_answer("fuzzy", "a", "a")


def test_gsm8k_pairs_end_in_the_answer_the_extraction_reads() -> None:
    for split in ("test", "train"):
        rows, pairs = load_gsm8k(split), gsm8k_pairs(split)
        assert [p["id"] for p in pairs] == list(rows["id"])
        for pair, question, final in zip(pairs, rows["question"], rows["final"]):
            assert pair["prompt"] == math_message(question)
            assert "####" not in pair["response"] and pair["response"].endswith(f"\nThe answer is {final}.")
            assert extract_gsm8k_answer(pair["response"]) == normalize_number(final)


# ------------------------------------------------------------------------------ teacher-forced scorers
def _hand_nll(model, tok, pair: dict) -> float:
    """Reference: one unpadded forward per pair, rendered with render_chat, mean NLL of the response tokens."""
    head, tail = render_chat(tok, pair["prompt"], pair["response"])
    p = tok(head, add_special_tokens=tok.chat_template is None)["input_ids"]
    r = tok(tail, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([p + r])).logits[0].float(), -1)
    return float(-logp[len(p) - 1 : -1].gather(1, torch.tensor(r)[:, None]).mean())


def test_reference_nll_matches_a_per_example_loop(tiny, tmp_path) -> None:
    model, tok = tiny
    skill = _write_jsonl(
        tmp_path / "skill.jsonl",
        [
            {"id": "s1", "prompt": "What is 2 + 3?", "response": "The answer is 5."},
            {"id": "s2", "prompt": "Write add.", "response": "def add(a, b):\n    return a + b"},
            {"id": "s3", "prompt": "Say hi " * 20, "response": "hi"},
        ],
    )
    for source, pairs in (("gsm8k", gsm8k_pairs("test")[:4]), (skill, [json.loads(x) for x in open(skill)])):
        hand = {p["id"]: _hand_nll(model, tok, p) for p in pairs}
        cut = statistics.median(hand.values())
        scorer = build_scorer("reference-nll", {"source": source, "limit": 4, "batch_size": 3, "solved_below": cut})
        assert scorer.problem_ids() == list(hand) and not scorer.higher_is_better and scorer.aggregate == "mean"
        values = scorer.score(model, tok)
        assert list(values) == list(hand)
        for q, s in values.items():
            assert s.value == pytest.approx(hand[q], abs=2e-5) and s.answer == f"{s.value:.6f}"
            assert s.correct == (hand[q] < cut)
            assert scorer.restore(s.answer, s.correct) == s  # what the ledger keeps gives the same score back
        assert 0 < sum(s.correct for s in values.values()) < len(values)
        assert scorer.summarise(values) == pytest.approx(statistics.mean(hand.values()), abs=2e-5)
        one_by_one = build_scorer("reference-nll", {"source": source, "limit": 4, "batch_size": 1, "solved_below": cut})
        assert {q: s.value for q, s in one_by_one.score(model, tok).items()} == pytest.approx(
            {q: s.value for q, s in values.items()}, abs=2e-6
        )


def _hand_agreement(model, tok, pairs: list[dict]) -> dict[str, float]:
    """Reference: the former flows.components.ResponseMatchScorer loop, one unpadded forward per example."""
    from atlas_core.train import TrainConfig, prepare_data

    data = prepare_data(tok, pairs, TrainConfig(max_length=2048, on_bad_example="truncate")).train
    out = {}
    with torch.no_grad():
        for ids, start, qid in zip(data.ids, data.prompt_len.tolist(), data.example_ids):
            logits = model(input_ids=ids[None]).logits[0, start - 1 : -1]
            out[qid] = (logits.argmax(-1) == ids[start:]).float().mean().item()
    return out


def test_response_match_batched_equals_per_example(chat_tiny) -> None:
    model, tok = chat_tiny
    pairs = mbpp_pairs("test")[:6]
    # A random model agrees with nothing; push its argmax to the references' most common token
    # (an adapter attached by a hook) so agreement varies between examples.
    common = (
        torch.cat([torch.tensor(tok(p["response"], add_special_tokens=False)["input_ids"]) for p in pairs])
        .mode()
        .values
    )
    bias = torch.zeros(len(tok))
    bias[common] = 50.0
    handle = model.lm_head.register_forward_hook(lambda m, i, out: out + bias)
    try:
        hand = _hand_agreement(model, tok, pairs)
        stats = response_stats(model, tok, pairs, batch_size=4)
        shares = {q: s.agreement for q, s in stats.items()}
        threshold = sorted(shares.values())[len(shares) // 2]  # one example sits exactly at the threshold
        scorer = build_scorer("response-match", {"source": "mbpp", "limit": 6, "batch_size": 4, "threshold": threshold})
        values = scorer.score(model, tok)
    finally:
        handle.remove()
    assert shares == pytest.approx(hand, abs=1e-6)
    assert 0 < min(hand.values()) < max(hand.values())
    assert list(values) == [p["id"] for p in pairs]
    assert {q: s.correct for q, s in values.items()} == {q: a >= threshold for q, a in shares.items()}
    assert all(s.answer == ("pass" if s.correct else "fail") and s.value == float(s.correct) for s in values.values())
    assert 0 < scorer.summarise(values) < len(pairs)


# ------------------------------------------------------------------------------ generated answers
def test_gsm8k_and_csqa_scorers_match_the_task_evaluations(chat_tiny) -> None:
    model, tok = chat_tiny
    gsm = build_scorer("gsm8k-accuracy", {"split": "train", "limit": 3, "max_new_tokens": 8})
    direct = tasks.eval_gsm8k(model, tok, split="train", limit=3, max_new_tokens=8).answers
    got = gsm.score(model, tok)
    assert list(got) == gsm.problem_ids() == [a.id for a in direct]
    assert [(s.answer, s.correct, s.value) for s in got.values()] == [
        (a.answer, a.correct, float(a.correct)) for a in direct
    ]
    csqa = build_scorer("csqa-choice", {"split": "train", "limit": 12, "batch_size": 5})
    direct = tasks.eval_csqa_choice(model, tok, split="train", limit=12).answers
    got = csqa.score(model, tok)
    assert [(q, s.answer, s.correct) for q, s in got.items()] == [(a.id, a.answer, a.correct) for a in direct]
    assert csqa.summarise(got) == sum(a.correct for a in direct)


def test_gsm8k_accuracy_counts_correct_final_answers(chat_tiny, monkeypatch) -> None:
    model, tok = chat_tiny
    finals = load_gsm8k("test")["final"][:4]
    fake = [f"so... The answer is {finals[0]}.", "The answer is -1.", f"#### {finals[2]}", "no idea"]
    monkeypatch.setattr(tasks, "generate", lambda *a, **k: fake)
    got = build_scorer("gsm8k-accuracy", {"limit": 4}).score(model, tok)
    assert [s.correct for s in got.values()] == [True, False, True, False]
    assert [s.answer for s in got.values()] == [normalize_number(finals[0]), "-1", normalize_number(finals[2]), None]


@pytest.mark.skipif(not (data_dir() / "mbppplus/MbppPlus-v0.2.0.jsonl").is_file(), reason="MBPP+ data not available")
def test_mbpp_plus_scores_each_problem_with_evalplus(chat_tiny, monkeypatch) -> None:
    model, tok = chat_tiny
    plus = load_mbpp_plus("test").select(range(2))
    fake = [f"```python\n{plus[0]['canonical_solution']}\n```", "```python\ndef nothing():\n    pass\n```"]
    monkeypatch.setattr(tasks, "generate", lambda *a, **k: fake)
    scorer = build_scorer("mbpp-plus", {"limit": 2})
    got = scorer.score(model, tok)
    assert list(got) == scorer.problem_ids() == list(plus["task_id"])
    assert [(s.answer, s.correct, s.value) for s in got.values()] == [("pass", True, 1.0), ("fail", False, 0.0)]


def test_exact_match_generates_from_the_trainer_prompt(tiny, tmp_path) -> None:
    model, tok = tiny
    prompts = ["What is 2 + 3?", "Name a colour.", "Where is money kept?"]
    # The trainer's prompt side of a pair: what a model trained on (prompt, answer) pairs answers after.
    completions = generate(model, tok, [render_chat(tok, p, "")[0] for p in prompts], max_new_tokens=6, progress=False)
    answers = [f"  {completions[0].upper()}\n", "definitely not this", completions[2]]
    path = _write_jsonl(
        tmp_path / "answers.jsonl",
        [{"id": f"q{i}", "prompt": p, "answer": a} for i, (p, a) in enumerate(zip(prompts, answers))],
    )
    scorer = build_scorer("exact-match", {"file": path, "max_new_tokens": 6, "batch_size": 2})
    got = scorer.score(model, tok)
    assert list(got) == ["q0", "q1", "q2"]
    assert [s.correct for s in got.values()] == [True, False, True]
    assert got["q1"].answer == " ".join(completions[1].split()).casefold()


# ------------------------------------------------------------------------------ names and cheap construction
def test_dataset_names_follow_every_setting_that_changes_answers(tmp_path) -> None:
    base = {
        "mbpp-plus": {},
        "gsm8k-accuracy": {},
        "csqa-choice": {},
        "reference-nll": {},
        "response-match": {},
        "exact-match": {"file": _write_jsonl(tmp_path / "a.jsonl", [{"id": "1", "prompt": "p", "answer": "a"}])},
    }
    changes = {
        "mbpp-plus": [("limit", 3), ("max_new_tokens", 64)],
        "gsm8k-accuracy": [("split", "train"), ("limit", 3), ("max_new_tokens", 64)],
        "csqa-choice": [("split", "train"), ("limit", 3)],
        "exact-match": [("limit", 3), ("max_new_tokens", 9), ("checker", "number")],
        "reference-nll": [
            ("source", "mbpp"),
            ("split", "train"),
            ("limit", 3),
            ("max_length", 64),
            ("solved_below", 0.5),
        ],
        "response-match": [("source", "gsm8k"), ("split", "validation"), ("limit", 3), ("threshold", 0.5)],
    }
    assert set(base) == set(SCORERS)
    names = set()
    for name, options in base.items():
        dataset = build_scorer(name, options).dataset
        assert dataset.startswith(name + "@") and dataset not in names
        names.add(dataset)
        assert build_scorer(name, {**options, "batch_size": 3}).dataset == dataset  # batching changes no answer
        for key, value in changes[name]:
            assert build_scorer(name, {**options, key: value}).dataset != dataset, (name, key)
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "1", "prompt": "p", "answer": "b"}) + "\n")
    assert build_scorer("exact-match", base["exact-match"]).dataset not in names  # the file's content counts


def test_building_loads_no_model_and_generates_nothing(tmp_path, monkeypatch) -> None:
    from evaluation import scorers_builtin

    def boom(*args, **kwargs):
        raise AssertionError("construction must not load data sets or generate")

    for fn in (
        "eval_mbpp_plus",
        "eval_gsm8k",
        "eval_csqa_choice",
        "generate",
        "response_stats",
        "load_gsm8k",
        "load_csqa",
        "load_mbpp_plus",
        "gsm8k_pairs",
        "mbpp_pairs",
    ):
        monkeypatch.setattr(scorers_builtin, fn, boom)
    file = _write_jsonl(tmp_path / "a.jsonl", [{"id": "1", "prompt": "p", "answer": "a"}])
    for name in SCORERS:
        assert isinstance(build_scorer(name, {"file": file} if name == "exact-match" else None), TargetScorer)


# ------------------------------------------------------------------------------ user scorers
class MyScorer(TargetScorer):
    """A user scorer: problem i is solved when i < solved; its options are `n` and `solved`."""

    name, aggregate = "my-scorer", "sum"

    def __init__(self, n: int, solved: int = 0, bad_value: bool = False):
        if n < 1:
            raise ValueError(f"options.n: expected a positive integer, got {n}")
        self.n, self.solved, self.bad_value = n, solved, bad_value
        self.dataset = f"my-scorer@{n}:{solved}"

    def problem_ids(self) -> list[str]:
        return [f"p{i}" for i in range(self.n)]

    def score(self, model, tokenizer) -> dict[str, ProblemScore]:
        return {
            q: ProblemScore(None, i < self.solved, 0.5 if self.bad_value else float(i < self.solved))
            for i, q in enumerate(self.problem_ids())
        }


class Incomplete:
    name, higher_is_better = "incomplete", "yes"

    def problem_ids(self):
        return ["a"]


def test_user_scorer_is_imported_built_with_options_and_checked() -> None:
    scorer = build_scorer(f"{HERE}:MyScorer", {"n": 4, "solved": 3})
    assert (scorer.name, scorer.dataset, scorer.higher_is_better, scorer.aggregate) == (
        "my-scorer",
        "my-scorer@4:3",
        True,
        "sum",
    )
    values = scorer.score(None, None)
    assert scorer.problem_ids() == list(values) == ["p0", "p1", "p2", "p3"] and scorer.summarise(values) == 3
    with pytest.raises(ValueError, match=r"\['p0'\].value is 0.5; a 'sum' scorer"):
        build_scorer(f"{HERE}:MyScorer", {"n": 2, "solved": 1, "bad_value": True}).score(None, None)


@pytest.mark.parametrize(
    "name, options, message",
    [
        (f"{HERE}:MyScorer", {"n": 2, "sloved": 1}, r"target.options.sloved: not an option of .*did you mean 'solved'"),
        (f"{HERE}:MyScorer", {}, r"target.options.n: required by"),
        (f"{HERE}:MyScorer", {"n": 0}, r"target.options.n: expected a positive integer, got 0"),
        (
            f"{HERE}:Incomplete",
            {},
            r"target.scorer: .* not a TargetScorer: dataset is None.*; higher_is_better is 'yes'"
            r".*; aggregate is None.*; score is not a method",
        ),
        (f"{HERE}:HERE", {}, r"target.scorer: .* is a str, not a callable"),
        (f"{HERE}:Missing", {}, r"target.scorer: module 'tests.test_eval_scorers' has no attribute 'Missing'"),
        ("no_such_package.mod:Factory", {}, r"target.scorer: cannot import module 'no_such_package.mod'"),
        ("tests.test_eval_scorers:", {}, r"target.scorer: expected 'package.module:Factory'"),
    ],
)
def test_user_scorer_errors(name, options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        build_scorer(name, options)


# ------------------------------------------------------------------------------ built-in errors
@pytest.mark.parametrize(
    "name, options, message",
    [
        ("gsm8k-acuracy", None, r"target.scorer: unknown scorer 'gsm8k-acuracy' \(did you mean 'gsm8k-accuracy'\?\)"),
        ("", None, r"target.scorer: expected a scorer name"),
        ("mbpp-plus", ["limit"], r"target.options: expected a mapping"),
        ("mbpp-plus", {"limt": 4}, r"target.options.limt: unknown field; expected one of \['limit'"),
        ("mbpp-plus", {"limit": "all"}, r"target.options.limit: expected an integer, got 'all'"),
        ("mbpp-plus", {"max_new_tokens": 0}, r"target.options.max_new_tokens: expected a positive integer, got 0"),
        ("gsm8k-accuracy", {"split": "validation"}, r"target.options.split: expected one of \['test', 'train'\]"),
        ("csqa-choice", {"split": "test"}, r"target.options.split: expected one of \['validation', 'train'\]"),
        ("csqa-choice", {"batch_size": -1}, r"target.options.batch_size: expected a positive integer"),
        ("exact-match", {}, r"target.options.file: expected the path of a JSONL file"),
        ("exact-match", {"file": "no/such.jsonl"}, r"target.options.file: file not found: no/such.jsonl"),
        ("exact-match", {"file": "{bad}", "checker": "fuzzy"}, r"target.options.checker: expected one of"),
        (
            "reference-nll",
            {"source": "mbpp", "split": "dev"},
            r"target.options.split: expected one of \['train', 'validation'",
        ),
        ("reference-nll", {"solved_below": 0}, r"target.options.solved_below: expected a positive number"),
        ("reference-nll", {"source": "no/such.jsonl"}, r"target.options.source: file not found"),
        (
            "reference-nll",
            {"source": "{skill}", "split": "test"},
            r"target.options.split: only for the built-in sources",
        ),
        ("response-match", {"threshold": 1.5}, r"target.options.threshold: expected a value in \(0, 1\]"),
        ("response-match", {"threshold": 0.9, "treshold": 0.5}, r"target.options.treshold: unknown field"),
    ],
)
def test_builtin_option_errors(name, options, message, tmp_path) -> None:
    files = {
        "{bad}": _write_jsonl(tmp_path / "a.jsonl", [{"id": "1", "prompt": "p", "answer": "a"}]),
        "{skill}": _write_jsonl(tmp_path / "s.jsonl", [{"id": "1", "prompt": "p", "response": "r"}]),
    }
    if isinstance(options, dict):
        options = {k: files.get(v, v) if isinstance(v, str) else v for k, v in options.items()}
    with pytest.raises(ConfigError, match=message):
        build_scorer(name, options)


@pytest.mark.parametrize(
    "name, key, rows, message",
    [
        (
            "exact-match",
            "file",
            [{"id": "1", "prompt": "p", "answer": "a"}, {"id": "2", "prompt": "p"}],
            r"target.options.file: .*a.jsonl: line 2: field 'answer' is missing",
        ),
        ("exact-match", "file", [{"id": "1", "prompt": "p", "answr": "a"}], r"line 1: field 'answer' is missing"),
        ("exact-match", "file", [{"id": "1", "prompt": "p", "answer": 5}], r"line 1: field 'answer' must be a string"),
        (
            "reference-nll",
            "source",
            [{"id": "1", "prompt": "p", "response": "r"}, {"id": "1", "prompt": "q", "response": "s"}],
            r"target.options.source: .*a.jsonl: line 2: field 'id' '1' repeats line 1",
        ),
        ("response-match", "source", [{"id": "1", "prompt": "", "response": "r"}], r"line 1: field 'prompt' is empty"),
    ],
)
def test_bad_jsonl_is_refused_when_the_scorer_is_built(name, key, rows, message, tmp_path) -> None:
    with pytest.raises(ConfigError, match=message):
        build_scorer(name, {key: _write_jsonl(tmp_path / "a.jsonl", rows)})
    (tmp_path / "b.jsonl").write_text('{"id": "1", "prompt": "p", "answer": "a"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"b.jsonl: line 2: not valid JSON"):
        build_scorer("exact-match", {"file": str(tmp_path / "b.jsonl")})
