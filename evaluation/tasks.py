"""Whole task evaluations for one model: data -> prompts -> generation/choice -> scores.

    code = eval_mbpp_plus(model, tok, limit=16)            # EvalPlusResult (+ completions)
    math = eval_gsm8k(model, tok, limit=16)                # list[Answer], accuracy
    csqa = eval_csqa_choice(model, tok, limit=16)          # list[Answer], accuracy

Each takes any Hugging Face causal LM and its tokenizer; `limit` keeps the first N problems
(a fixed, file-order subset) for smoke runs. Per-question answers can be written with
`answers.write_answers` and compared across models with `flows.compare.answer_churn`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evaluation.answers import ANSWER_GIVEN, Answer, score_gsm8k
from evaluation.choice import choose
from evaluation.data import load_csqa, load_gsm8k, load_mbpp_plus
from evaluation.evalplus_score import EvalPlusResult, score_mbpp_plus
from evaluation.generate import extract_code, generate
from evaluation.prompts import choice_message, code_message, math_message, render
from evaluation.timing import phase


@dataclass(frozen=True)
class CodeEval:
    result: EvalPlusResult
    completions: dict[str, str]  # task_id -> raw completion


@dataclass(frozen=True)
class AnswerEval:
    answers: list[Answer]
    accuracy: float


def _first(ds, limit: int | None):
    return ds if limit is None else ds.select(range(min(limit, len(ds))))


def eval_mbpp_plus(
    model: Any,
    tokenizer: Any,
    limit: int | None = None,
    max_new_tokens: int = 512,
    batch_size: int = 8,
    results_path: str | Path | None = None,
    chat_template_kwargs: dict | None = None,
) -> CodeEval:
    """Greedy pass@1 on the MBPP+ test problems (224, or the first `limit`)."""
    problems = _first(load_mbpp_plus("test"), limit)
    prompts = [
        render(tokenizer, code_message(p["text"], p["first_test"]), "code", chat_template_kwargs) for p in problems
    ]
    # The closing fence ends the answer: what follows (explanations, usage) is never scored.
    completions = generate(model, tokenizer, prompts, max_new_tokens, batch_size, stop=("\n```\n",), desc="MBPP+")
    solutions = {p["task_id"]: extract_code(c, p["entry_point"]) for p, c in zip(problems, completions)}
    with phase("EvalPlus (within answers of its set)"):
        result = score_mbpp_plus(solutions, results_path=results_path)
    return CodeEval(result, dict(zip(problems["task_id"], completions)))


def eval_gsm8k(
    model: Any,
    tokenizer: Any,
    split: str = "test",
    limit: int | None = None,
    max_new_tokens: int = 512,
    batch_size: int = 8,
    chat_template_kwargs: dict | None = None,
) -> AnswerEval:
    """Greedy GSM8K answers, extracted, normalised and graded per question."""
    rows = _first(load_gsm8k(split), limit)
    prompts = [render(tokenizer, math_message(q), "math", chat_template_kwargs) for q in rows["question"]]
    completions = generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens,
        batch_size,
        stop=("\nQuestion:",),
        stop_after=ANSWER_GIVEN,
        desc="GSM8K",
    )
    answers = score_gsm8k(rows["id"], completions, rows["final"])
    return AnswerEval(answers, sum(a.correct for a in answers) / len(answers))


def eval_csqa_choice(
    model: Any,
    tokenizer: Any,
    split: str = "validation",
    limit: int | None = None,
    batch_size: int = 16,
    chat_template_kwargs: dict | None = None,
) -> AnswerEval:
    """CSQA conditional choice: the most likely label A-E after one shared prompt."""
    rows, prompts = csqa_choice_prompts(tokenizer, split, limit, chat_template_kwargs)
    result = choose(model, tokenizer, prompts, batch_size=batch_size)
    answers = result.answers(rows["id"], rows["answer"])
    return AnswerEval(answers, result.accuracy(rows["answer"]))


def csqa_choice_prompts(
    tokenizer: Any, split: str = "validation", limit: int | None = None, chat_template_kwargs: dict | None = None
) -> tuple[Any, list[str]]:
    """The CSQA rows (the first `limit`) and their rendered choice prompts."""
    rows = _first(load_csqa(split), limit)
    return rows, [
        render(tokenizer, choice_message(s, t), "choice", chat_template_kwargs)
        for s, t in zip(rows["stem"], rows["texts"])
    ]
