"""The built-in target scorers (evaluation/scorers.py builds them by name).

    mbpp-plus        EvalPlus pass@1 of greedy code on MBPP+ test problems       sum, higher is better
    gsm8k-accuracy   greedy final answer, numeric match                          sum, higher is better
    csqa-choice      conditional-choice accuracy (most likely label A-E)         sum, higher is better
    exact-match      greedy completion vs a JSONL file's `answer`                sum, higher is better
    reference-nll    teacher-forced NLL of held-out reference responses          mean, lower is better
    response-match   share of reference tokens the model's argmax predicts       sum, higher is better

Each class takes its options dataclass; constructing one loads no model and generates
nothing (a file source is read and schema-checked, built-in data sets load on first use),
so a flow can build every skill's scorer before training starts.

The teacher-forced scorers render a (prompt, response) pair exactly as the trainer does
(`atlas_core.train.prepare_data`), so "the NLL of the reference" is the training loss of
that pair: one right-padded batched forward per batch, logits only at response positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from atlas_core.backbone import full_hidden, head_logits
from atlas_core.errors import InputError
from atlas_core.train import TrainConfig, collate, prepare_data, render_chat
from atlas_core.typed_config import field
from evaluation.answers import CHECKERS, grade_answer
from evaluation.data import (
    CSQA_FILES,
    GSM8K_FILES,
    MBPP_SPLITS,
    gsm8k_pairs,
    load_csqa,
    load_gsm8k,
    load_mbpp_plus,
    mbpp_pairs,
)
from evaluation.generate import generate
from evaluation.scorer_base import (
    ProblemScore,
    TargetScorer,
    existing_file,
    file_tag,
    in_order,
    limit_tag,
    mean_score,
    one_of,
    positive,
    solved,
)
from evaluation.tasks import eval_csqa_choice, eval_gsm8k, eval_mbpp_plus
from evaluation.userdata import load_answer_jsonl, load_skill_jsonl


def _first(rows: list, limit: int | None) -> list:
    return rows if limit is None else rows[:limit]


# ------------------------------------------------------------------------------ generated answers
@dataclass
class MbppPlusOptions:
    limit: int | None = field("First N MBPP+ test problems (null: all 224).", 16)
    max_new_tokens: int = field("Greedy generation budget per problem (it also stops at the closing code fence).", 256)
    batch_size: int = field(
        "Prompts decoded together (a finished one leaves the batch, so more cost little; "
        "in bf16 the batch changes the rounding, see evaluation/generate.py).",
        32,
    )

    def __post_init__(self) -> None:
        positive(self, "limit", "max_new_tokens", "batch_size")


class MbppPlusScorer(TargetScorer):
    """EvalPlus pass@1 (base and plus tests, in a sandboxed child process); answer 'pass'/'fail'."""

    name, Options = "mbpp-plus", MbppPlusOptions

    def __init__(self, options: MbppPlusOptions | None = None):
        self.options = o = options or MbppPlusOptions()
        self.dataset = f"mbpp-plus@test:{limit_tag(o.limit)}:{o.max_new_tokens}tok"

    def problem_ids(self) -> list[str]:
        return _first(list(load_mbpp_plus("test")["task_id"]), self.options.limit)

    def score(self, model: Any, tokenizer: Any) -> dict[str, ProblemScore]:
        o = self.options
        code = eval_mbpp_plus(model, tokenizer, limit=o.limit, max_new_tokens=o.max_new_tokens, batch_size=o.batch_size)
        got = {p.task_id: solved("pass" if p.passed else "fail", p.passed) for p in code.result.problems}
        return in_order(self.problem_ids(), got, self.name)


@dataclass
class Gsm8kOptions:
    split: str = field(f"GSM8K split, one of {list(GSM8K_FILES)}.", "test")
    limit: int | None = field("First N questions of the split (null: all).", 16)
    max_new_tokens: int = field(
        "Greedy generation budget per question (it also stops once 'The answer is N' is written).", 192
    )
    batch_size: int = field(
        "Prompts decoded together (a finished one leaves the batch, so more cost little; "
        "in bf16 the batch changes the rounding, see evaluation/generate.py).",
        32,
    )

    def __post_init__(self) -> None:
        one_of("split", self.split, list(GSM8K_FILES))
        positive(self, "limit", "max_new_tokens", "batch_size")


class _BenchmarkScorer(TargetScorer):
    """A built-in benchmark split, scored question by question: answer = the extracted answer."""

    def problem_ids(self) -> list[str]:
        return _first(list(self.load(self.options.split)["id"]), self.options.limit)

    def score(self, model: Any, tokenizer: Any) -> dict[str, ProblemScore]:
        got = self.answers(model, tokenizer)
        return in_order(self.problem_ids(), {a.id: solved(a.answer, a.correct) for a in got}, self.name)


class Gsm8kAccuracyScorer(_BenchmarkScorer):
    """Greedy GSM8K: the extracted final number against the reference; answer = that number."""

    name, Options = "gsm8k-accuracy", Gsm8kOptions
    load = staticmethod(load_gsm8k)

    def __init__(self, options: Gsm8kOptions | None = None):
        self.options = o = options or Gsm8kOptions()
        self.dataset = f"gsm8k-accuracy@{o.split}:{limit_tag(o.limit)}:{o.max_new_tokens}tok"

    def answers(self, model: Any, tokenizer: Any) -> list:
        o = self.options
        return eval_gsm8k(
            model, tokenizer, split=o.split, limit=o.limit, max_new_tokens=o.max_new_tokens, batch_size=o.batch_size
        ).answers


@dataclass
class CsqaOptions:
    split: str = field(f"CommonsenseQA split, one of {list(CSQA_FILES)}.", "validation")
    limit: int | None = field("First N questions of the split (null: all).", 64)
    batch_size: int = field("Prompts per forward batch.", 16)

    def __post_init__(self) -> None:
        one_of("split", self.split, list(CSQA_FILES))
        positive(self, "limit", "batch_size")


class CsqaChoiceScorer(_BenchmarkScorer):
    """Conditional choice: the label A-E with the highest next-token likelihood; answer = that label."""

    name, Options = "csqa-choice", CsqaOptions
    load = staticmethod(load_csqa)

    def __init__(self, options: CsqaOptions | None = None):
        self.options = o = options or CsqaOptions()
        self.dataset = f"csqa-choice@{o.split}:{limit_tag(o.limit)}"

    def answers(self, model: Any, tokenizer: Any) -> list:
        o = self.options
        return eval_csqa_choice(model, tokenizer, split=o.split, limit=o.limit, batch_size=o.batch_size).answers


@dataclass
class ExactMatchOptions:
    file: str = field(
        "JSONL answer set: rows with id, prompt and answer (a retained set, or a retained domain whose "
        "rows all have an answer; evaluation/userdata.py).",
        "",
    )
    limit: int | None = field("First N rows of the file (null: all).", None)
    max_new_tokens: int = field("Greedy generation budget per prompt.", 64)
    batch_size: int = field(
        "Prompts decoded together (a finished one leaves the batch, so more cost little; "
        "in bf16 the batch changes the rounding, see evaluation/generate.py).",
        32,
    )
    checker: str = field(
        f"How a completion is graded, one of {CHECKERS}: 'exact' compares the whole completion with "
        "the answer after whitespace/case normalisation; 'number' compares final numbers.",
        "exact",
    )

    def __post_init__(self) -> None:
        existing_file("file", self.file)
        one_of("checker", self.checker, CHECKERS)
        positive(self, "limit", "max_new_tokens", "batch_size")


def pair_prompt(tokenizer: Any, prompt: str) -> str:
    """What a model continues from for a user prompt: the prompt side of the trainer's pair rendering."""
    return render_chat(tokenizer, prompt, "")[0]


class ExactMatchScorer(TargetScorer):
    """Greedy completion of each prompt, graded against the row's answer; answer = the graded text."""

    name, Options = "exact-match", ExactMatchOptions

    def __init__(self, options: ExactMatchOptions):
        self.options = o = options
        path = existing_file("file", o.file)
        try:
            self.rows = _first(load_answer_jsonl(path), o.limit)
        except ValueError as e:
            raise InputError(f"options.file: {e}") from e
        self.dataset = f"exact-match@{file_tag(path)}:{limit_tag(o.limit)}:{o.max_new_tokens}tok:{o.checker}"

    def problem_ids(self) -> list[str]:
        return [r.id for r in self.rows]

    def score(self, model: Any, tokenizer: Any) -> dict[str, ProblemScore]:
        o = self.options
        prompts = [pair_prompt(tokenizer, r.prompt) for r in self.rows]
        completions = generate(model, tokenizer, prompts, o.max_new_tokens, o.batch_size, desc="exact-match")
        return {r.id: solved(*grade_answer(o.checker, c, r.answer)) for r, c in zip(self.rows, completions)}


# ------------------------------------------------------------------------------ teacher-forced references
PAIR_SOURCES = {"gsm8k": list(GSM8K_FILES), "mbpp": list(MBPP_SPLITS)}  # built-in source -> its splits


@dataclass(frozen=True)
class ResponseStats:
    nll: float  # mean negative log-likelihood of the response tokens, nats/token
    agreement: float  # share of response tokens that are the model's argmax prediction
    tokens: int  # supervised (response) tokens


@torch.no_grad()
def response_stats(
    model: Any, tokenizer: Any, pairs: list[dict], batch_size: int = 8, max_length: int = 2048
) -> dict[str, ResponseStats]:
    """Teacher-forced statistics of each pair's response given its prompt, keyed by pair id.

    Pairs are tokenised by the trainer's own `prepare_data` (chat rendering, over-long
    responses cut to `max_length`); a pair left with no response token is absent."""
    data = prepare_data(tokenizer, pairs, TrainConfig(max_length=max_length, on_bad_example="truncate"))
    rows = data.train
    device = next(model.parameters()).device
    order = torch.sort(rows.lengths, descending=True, stable=True).indices.tolist()  # similar lengths: little padding
    out: dict[str, ResponseStats] = {}
    for start in range(0, len(order), batch_size):
        batch = collate(rows, order[start : start + batch_size], data.pad_id)  # right padding, response targets
        ids, mask, targets = batch.ids.to(device), batch.mask.to(device), batch.targets.to(device)
        supervised = targets != -100
        logits = head_logits(model, full_hidden(model, ids, mask)[supervised]).float()  # (N, V): response positions
        wanted = targets[supervised]
        nll = F.cross_entropy(logits, wanted, reduction="none")
        hit = (logits.argmax(-1) == wanted).float()
        row_of = supervised.nonzero()[:, 0]  # which example each supervised position belongs to
        count = supervised.sum(1)
        nll_sum = torch.zeros(len(count), device=device).index_add_(0, row_of, nll)
        hit_sum = torch.zeros(len(count), device=device).index_add_(0, row_of, hit)
        for i, n, total, hits in zip(batch.index, count.tolist(), nll_sum.tolist(), hit_sum.tolist()):
            out[rows.example_ids[i]] = ResponseStats(total / n, hits / n, n)
    return out


_SOURCE_HELP = (
    "Held-out (prompt, response) pairs: 'gsm8k' (math prompt -> reference solution ending 'The answer is N.'), "
    "'mbpp' (code prompt -> reference code) or a JSONL skill file (prompt/response)."
)


@dataclass
class PairOptions:
    source: str = field(_SOURCE_HELP, "mbpp")
    split: str | None = field("Split of a built-in source (null: 'test'); not used with a file.", None)
    limit: int | None = field("First N pairs (null: all).", 16)
    batch_size: int = field("Pairs per forward batch.", 8)
    max_length: int = field("Prompt + response tokens kept per pair; a longer response is cut.", 2048)

    def __post_init__(self) -> None:
        if self.source in PAIR_SOURCES:
            if self.split is not None:
                one_of("split", self.split, PAIR_SOURCES[self.source])
        else:
            existing_file("source", self.source)
            if self.split is not None:
                raise InputError(
                    f"options.split: only for the built-in sources {list(PAIR_SOURCES)}; a file is "
                    f"read whole, got split {self.split!r}"
                )
        positive(self, "limit", "batch_size", "max_length")


class _PairScorer(TargetScorer):
    """Common part of the teacher-forced scorers: the pairs and their part of the dataset name."""

    def __init__(self, options: PairOptions):
        self.options = o = options
        if o.source in PAIR_SOURCES:
            self._file_pairs = None
            where = f"{o.source}:{o.split or 'test'}"
        else:
            path = existing_file("source", o.source)
            try:
                self._file_pairs = [
                    {"prompt": e.prompt, "response": e.response, "id": e.id} for e in load_skill_jsonl(path)
                ]
            except ValueError as e:
                raise InputError(f"options.source: {e}") from e
            where = file_tag(path)
        self.source_tag = f"{where}:{limit_tag(o.limit)}:{o.max_length}tok"

    @cached_property
    def pairs(self) -> list[dict]:
        o = self.options
        if self._file_pairs is not None:
            pairs = self._file_pairs
        else:
            pairs = (gsm8k_pairs if o.source == "gsm8k" else mbpp_pairs)(o.split or "test")
        return _first(pairs, o.limit)

    def problem_ids(self) -> list[str]:
        return [p["id"] for p in self.pairs]

    def stats(self, model: Any, tokenizer: Any) -> dict[str, ResponseStats]:
        return response_stats(model, tokenizer, self.pairs, self.options.batch_size, self.options.max_length)


@dataclass
class ReferenceNLLOptions(PairOptions):
    source: str = field(_SOURCE_HELP, "gsm8k")
    limit: int | None = field("First N pairs (null: all).", 64)
    solved_below: float = field("A problem counts as solved when its mean NLL (nats/token) is below this.", 1.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.solved_below > 0:
            raise InputError(
                f"options.solved_below: expected a positive number of nats/token, got {self.solved_below!r}"
            )


class ReferenceNLLScorer(_PairScorer):
    """Mean NLL per response token of each held-out reference (lower is better): a smooth measure
    for a skill a small model learns as a format before it learns it as accuracy."""

    name, Options = "reference-nll", ReferenceNLLOptions
    higher_is_better, aggregate = False, "mean"

    def __init__(self, options: ReferenceNLLOptions | None = None):
        super().__init__(options or ReferenceNLLOptions())
        self.dataset = f"reference-nll@{self.source_tag}:<{self.options.solved_below:g}"

    def score(self, model: Any, tokenizer: Any) -> dict[str, ProblemScore]:
        stats = self.stats(model, tokenizer)
        ids = self.problem_ids()
        dropped = [q for q in ids if q not in stats]
        if dropped:  # a mean over the rest would silently change what is measured
            raise InputError(
                f"reference-nll: {len(dropped)} pair(s) have no response token within options.max_length="
                f"{self.options.max_length}: {dropped[:5]}; raise max_length or shorten their prompts"
            )
        return {q: mean_score(stats[q].nll, stats[q].nll < self.options.solved_below) for q in ids}


@dataclass
class ResponseMatchOptions(PairOptions):
    threshold: float = field("Share of reference tokens the model's argmax must predict to solve a problem.", 0.9)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.threshold <= 1:
            raise InputError(f"options.threshold: expected a value in (0, 1], got {self.threshold!r}")


class ResponseMatchScorer(_PairScorer):
    """Teacher-forced agreement with the reference (no test harness needed); answer 'pass'/'fail'.
    A pair left without response tokens (prompt longer than max_length) counts as unsolved."""

    name, Options = "response-match", ResponseMatchOptions

    def __init__(self, options: ResponseMatchOptions | None = None):
        super().__init__(options or ResponseMatchOptions())
        self.dataset = f"response-match@{self.source_tag}:{self.options.threshold:g}"

    def score(self, model: Any, tokenizer: Any) -> dict[str, ProblemScore]:
        stats = self.stats(model, tokenizer)
        passed = {q: q in stats and stats[q].agreement >= self.options.threshold for q in self.problem_ids()}
        return {q: solved("pass" if ok else "fail", ok) for q, ok in passed.items()}


BUILTIN_SCORERS: dict[str, type[TargetScorer]] = {
    cls.name: cls
    for cls in (
        MbppPlusScorer,
        Gsm8kAccuracyScorer,
        CsqaChoiceScorer,
        ExactMatchScorer,
        ReferenceNLLScorer,
        ResponseMatchScorer,
    )
}
