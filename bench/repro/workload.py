"""What an experiment runs on: the model, the data subsets, the atlas and the two scorers.

The runner only sees a `Workload`, so tests hand it a tiny model and a fake target scorer,
while `default_workload` builds the real one from the platform's own pieces:
    backbone        atlas_core.backbone.load_backbone (bf16 or fp32)
    training data   MBPP train (120) / validation (43): problem + first test -> reference code
    held-out set    MBPP+ test problems: the same prompt -> canonical solution (NLL target measure)
    KL contexts     evaluation.contexts.retained_contexts (GSM8K test: math prompt + reference answer)
    atlas           evaluation.contexts + atlas_core.extract.sample_activations + fit_atlas, fitted
                    once per experiment and kept in the state dir
    target scorer   evaluation.tasks.eval_mbpp_plus (greedy generation + EvalPlus)
    answers         evaluation.tasks.eval_gsm8k (greedy; for answer churn of final checkpoints)
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ReproConfig


@dataclass(frozen=True)
class TargetScore:
    n: int
    solved: int  # base and plus tests (MBPP+ pass@1)
    base_solved: int  # base tests only
    solved_ids: list[str]
    base_solved_ids: list[str]


@dataclass
class Workload:
    model: Any
    tokenizer: Any
    train_pairs: list[dict]  # {"prompt", "response", "id"}
    val_pairs: list[dict]
    heldout_pairs: list[dict]
    kl_contexts: list[str]
    score_target: Callable[[Any, Any], TargetScore]
    answer_retained: Callable[[Any, Any], list]  # -> list[evaluation.answers.Answer]
    atlas: Any = None  # atlas_core.atlas.Atlas, for the methods that need one
    info: dict = field(default_factory=dict)  # backbone revision, atlas file, ...
    calibration: list[str] = field(default_factory=list)  # the atlas's retained contexts (LoRA-Null, O-LoRA, CorDA)
    kl_prompts: list[str] | None = None  # the prompt each KL context begins with (KL by position kind)


def heldout_pairs(limit: int) -> list[dict]:
    """The first `limit` MBPP+ test problems with their canonical solutions."""
    from evaluation.data import load_mbpp_plus
    from evaluation.prompts import code_pair

    rows = load_mbpp_plus("test")
    rows = rows.select(range(min(limit, len(rows))))
    return [code_pair(r["text"], r["first_test"], r["canonical_solution"], r["task_id"]) for r in rows]


def atlas_path(config: ReproConfig, root: Path) -> Path:
    """Shared by every experiment with the same backbone, layer and atlas spec: a smoke run fits
    the atlas the full run then loads, and the fp32 check uses the same atlas as the bf16 run
    (the dtype it was extracted in is in its meta; routing always runs in fp32)."""
    key = json.dumps([config.backbone, config.layer, config.atlas.to_dict()], sort_keys=True)
    return (
        root
        / "atlases"
        / f"{config.backbone}-L{config.layer}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.safetensors"
    )


def first_positions(positions: str, tokenizer, prompts: list[str], texts: list[str]) -> list[int] | None:
    """Per calibration context, the first position the atlas may sample (atlas.positions; None: any).

    'response': the first position whose state has seen some of the answer (the prompt's token count);
    'after-first': 1, so that only position 0 stays out: the attention sink, the same state in every
    context (the chat template's first token), its layer-15 norm ~150x the median (SmolLM2-135M)."""
    from evaluation.kl import prompt_token_counts

    if positions == "response":
        return prompt_token_counts(tokenizer, texts, prompts, tokenizer(texts, add_special_tokens=False)["input_ids"])
    if positions == "after-first":
        return [1] * len(texts)
    return None


def fit_or_load_atlas(config: ReproConfig, model, tokenizer, path: Path):
    """The experiment's atlas: loaded (sha256-checked) if this session or an earlier one fitted it."""
    from atlas_core.atlas import Atlas, AtlasConfig, fit_atlas
    from atlas_core.extract import sample_activations
    from evaluation.contexts import retained_prompts

    if path.is_file():
        return Atlas.load(path)
    spec = config.atlas
    atlas_config = AtlasConfig(
        num_charts=spec.charts,
        rank=spec.rank,
        num_vectors=spec.num_vectors,
        per_example=spec.per_example,
        seed=spec.seed,
    )
    examples = -(-spec.num_vectors // spec.per_example)
    ids, prompts, texts = retained_prompts(tokenizer, spec.retained, spec.split, limit=examples)
    first = first_positions(spec.positions, tokenizer, prompts, texts)
    started = time.perf_counter()
    x = sample_activations(
        model,
        tokenizer,
        texts,
        config.layer,
        spec.num_vectors,
        spec.per_example,
        spec.seed,
        progress=False,
        first=first,
    )
    meta = {
        "layer": config.layer,
        "backbone": config.backbone,
        "dtype": config.dtype,
        "data": f"{spec.retained} {spec.split}: first {len(ids)} contexts (prompt + reference answer)"
        + {"all": "", "response": ", response positions only", "after-first": ", all positions but the first"}[
            spec.positions
        ],
    }
    atlas = fit_atlas(x, atlas_config, meta)
    atlas.save(path)
    print(
        f"[repro] atlas: {len(x)} vectors from {len(ids)} {spec.retained} {spec.split} contexts, "
        f"fitted in {time.perf_counter() - started:.0f} s -> {path}",
        flush=True,
    )
    return Atlas.load(path)  # loaded back so that its sha256 is known


def default_workload(config: ReproConfig, state: Path) -> Workload:
    """The real workload on `config.backbone` (offline; data verified by sha256)."""
    from atlas_core.backbone import load_backbone
    from evaluation.contexts import retained_contexts, retained_prompts
    from evaluation.data import mbpp_pairs
    from evaluation.tasks import eval_gsm8k, eval_mbpp_plus

    backbone = load_backbone(config.backbone, config.dtype)
    model, tokenizer = backbone.model, backbone.tokenizer
    ev = config.eval

    def score_target(m, tok) -> TargetScore:
        result = eval_mbpp_plus(
            m, tok, limit=ev.mbpp_plus_limit, max_new_tokens=ev.max_new_tokens, batch_size=ev.gen_batch_size
        ).result
        return TargetScore(
            result.n,
            result.solved,
            result.base_solved,
            result.solved_ids(),
            [p.task_id for p in result.problems if p.base_passed],
        )

    def answer_retained(m, tok) -> list:
        return eval_gsm8k(
            m, tok, limit=ev.churn_questions, max_new_tokens=ev.max_new_tokens, batch_size=ev.gen_batch_size
        ).answers

    needs_atlas = any(config.run_config(m.name, 0, 1.0).atlas is not None for m in config.methods)
    atlas = fit_or_load_atlas(config, model, tokenizer, atlas_path(config, state.parent)) if needs_atlas else None
    _, prompts, contexts = retained_prompts(tokenizer, "gsm8k", "test", limit=ev.kl_contexts)
    spec, calibration = config.atlas, []
    if any(
        rc.adapter == "weight-lora" and rc.lora.needs_stats
        for rc in (config.run_config(m.name, 0, 1.0) for m in config.methods)
    ):
        _, calibration = retained_contexts(
            tokenizer, spec.retained, spec.split, limit=-(-spec.num_vectors // spec.per_example)
        )
    return Workload(
        model,
        tokenizer,
        mbpp_pairs("train"),
        mbpp_pairs("validation"),
        heldout_pairs(ev.heldout_limit),
        contexts,
        score_target,
        answer_retained,
        atlas,
        info={"backbone": backbone.name, "revision": backbone.revision, "dtype": config.dtype},
        calibration=calibration,
        kl_prompts=prompts,
    )
