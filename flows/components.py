"""The pluggable parts of a cycle: backbone loading, skill data and target scorers.

A scorer answers one question per problem: solved or not. Two ship here:
- `mbpp-plus`: greedy generation, code extraction, EvalPlus base + plus tests (in a child process);
- `response-match`: teacher-forced agreement with a reference response (a problem is solved
  when the model's argmax predicts at least `threshold` of the reference tokens). It needs
  no test harness, so it serves skills without tests and the tiny-model flow tests.
`register_scorer(name, factory)` adds others; a factory takes (UpdateConfig, tokenizer).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import UpdateConfig, resolve

TINY_BACKBONE = "tiny-llama"


def load_model(name: str, dtype: str):
    """An `atlas_core.backbone.Backbone` in `dtype` (a name from DTYPES, 'auto' included);
    'tiny-llama' is a seeded random 4-layer fp32 toy (tests)."""
    from atlas_core.backbone import Backbone, decoder_layers, load_backbone

    if name != TINY_BACKBONE:
        return load_backbone(name, dtype)
    from evaluation.tiny import tiny_llama, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_llama(len(tokenizer), seed=0, hidden_size=64, layers=4)
    model.config.max_position_embeddings = 2048  # GSM8K contexts in a 400-token BPE run long
    return Backbone(TINY_BACKBONE, f"tiny-seed0-d64-l4-v{len(tokenizer)}", model, tokenizer, decoder_layers(model))


# ------------------------------------------------------------------------------ skill data
@dataclass(frozen=True)
class SkillSet:
    """Training pairs of the skill plus what identifies them in the ledger."""

    train: list[dict]
    val: list[dict]
    dataset_name: str
    split: str
    sha256: str


def _jsonl_pairs(path: str) -> list[dict]:
    from evaluation.userdata import load_skill_jsonl

    return [{"prompt": e.prompt, "response": e.response, "id": e.id} for e in load_skill_jsonl(resolve(path))]


def _first(rows: list, limit: int | None) -> list:
    return rows if limit is None else rows[:limit]


def skill_set(config: UpdateConfig) -> SkillSet:
    data = config.data
    if data.source == "mbpp":
        from evaluation.data import mbpp_pairs
        from evaluation.datafiles import known

        train, val = mbpp_pairs("train"), mbpp_pairs("validation")
        name, sha = "mbpp-sanitized", known("mbpp/sanitized-mbpp.json").sha256
    else:
        from registry import sha256_file

        train = _jsonl_pairs(data.source)
        val = _jsonl_pairs(data.val_source) if data.val_source else []
        name, sha = Path(data.source).stem, sha256_file(resolve(data.source))
    split = f"train[:{data.train_limit}]" if data.train_limit else "train"
    return SkillSet(_first(train, data.train_limit), _first(val, data.val_limit), name, split, sha)


# ------------------------------------------------------------------------------ target scorers
class TargetScorer:
    """Scores one model on a fixed problem list; `dataset` names its answers in the ledger."""

    dataset: str

    def problem_ids(self) -> list[str]:
        raise NotImplementedError

    def score(self, model, tokenizer) -> dict[str, bool]:
        raise NotImplementedError


class MbppPlusScorer(TargetScorer):
    def __init__(self, config: UpdateConfig, tokenizer=None):
        self.spec = config.target
        self.dataset = f"mbpp-plus@{self.spec.max_new_tokens}tok"

    def problem_ids(self) -> list[str]:
        from evaluation.data import load_mbpp_plus

        return _first(list(load_mbpp_plus("test")["task_id"]), self.spec.limit)

    def score(self, model, tokenizer) -> dict[str, bool]:
        from evaluation.tasks import eval_mbpp_plus

        code = eval_mbpp_plus(model, tokenizer, limit=self.spec.limit, max_new_tokens=self.spec.max_new_tokens,
                              batch_size=self.spec.batch_size)
        return {p.task_id: p.passed for p in code.result.problems}


class ResponseMatchScorer(TargetScorer):
    """Held-out pairs: MBPP test (source 'mbpp') or the skill file's validation pairs."""

    def __init__(self, config: UpdateConfig, tokenizer=None):
        from evaluation.data import mbpp_pairs

        self.spec = config.target
        self.dataset = f"response-match@{self.spec.threshold:g}"
        data = config.data
        pairs = mbpp_pairs("test") if data.source == "mbpp" else (_jsonl_pairs(data.val_source) if data.val_source else [])
        if not pairs:
            raise ValueError("target.scorer: 'response-match' needs held-out pairs (data.val_source for a JSONL skill)")
        self.pairs = _first(pairs, self.spec.limit)

    def problem_ids(self) -> list[str]:
        return [p["id"] for p in self.pairs]

    @torch.no_grad()
    def score(self, model, tokenizer) -> dict[str, bool]:
        from atlas_core.train import TrainConfig, prepare_data

        data = prepare_data(tokenizer, self.pairs, TrainConfig(max_length=2048, on_bad_example="truncate")).train
        device = next(model.parameters()).device
        out = {}
        for ids, start, qid in zip(data.ids, data.prompt_len.tolist(), data.example_ids):
            logits = model(input_ids=ids[None].to(device)).logits[0, start - 1 : -1]
            agree = (logits.argmax(-1).cpu() == ids[start:]).float().mean().item()
            out[qid] = agree >= self.spec.threshold
        return {qid: out.get(qid, False) for qid in self.problem_ids()}  # dropped examples count as unsolved


SCORER_FACTORIES: dict[str, Callable[..., TargetScorer]] = {
    "mbpp-plus": MbppPlusScorer,
    "response-match": ResponseMatchScorer,
}


def register_scorer(name: str, factory: Callable[..., TargetScorer]) -> None:
    SCORER_FACTORIES[name] = factory


def make_scorer(config: UpdateConfig, tokenizer=None) -> TargetScorer:
    try:
        factory = SCORER_FACTORIES[config.target.scorer]
    except KeyError:
        raise ValueError(f"target.scorer: unknown scorer {config.target.scorer!r}; known: {sorted(SCORER_FACTORIES)}")
    return factory(config, tokenizer)


def retained_data_files(domains: list[str]) -> dict[str, str]:
    """domain -> the verified data file its contexts and questions come from."""
    files = {"gsm8k": "gsm8k/test.jsonl", "csqa": "csqa/dev_rand_split.jsonl"}
    return {d: files[d] for d in domains}


def json_dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, default=str)
