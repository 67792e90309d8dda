"""One candidate's whole evaluation on the main job's subsets, the previous implementation against
the current one, side by side in one run, with every measured value compared.

The evaluation of v1's cycle: MBPP+ (32 problems, EvalPlus), GSM8K answers (16), CSQA choice (128),
retained KL on 128 GSM8K + 128 CSQA contexts against the base and the champion.
    previous  transformers' `generate` in batches of 8 (the stop_after check decoding every row's
              whole suffix at every step, ended rows decoded on to the batch's end); retained KL
              one pass per reference, every batch's whole (B, T, V) logits
    current   evaluation.generate (ended rows leave the batch; a windowed stop check; a KV cache
              written in place) with the main job's batches (MBPP+ 32, GSM8K 16); RetainedKL.kl_many
              (one candidate pass for all references, the LM head on real positions in chunks)
CSQA choice: previous full forwards (the head fed a strided slice); current the layers above the prefix from the
base's stored layer-l states (computed once per line and prompt set, like the KL's prefix: timed apart). Candidates:
the main job's v1 (its champion then was the base) and v2 (champion v1), and the base's answers; run
`bash scripts/main.sh` first, ATLAS_STATE_DIR as there.

    .venv/bin/python bench/eval_candidate.py [--contexts 128] [--dtype auto] [--answers-only]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from atlas_core.backbone import head_logits
from bench.common import machine, reading
from evaluation.answers import ANSWER_GIVEN, extract_gsm8k_answer
from evaluation.choice import ChoiceSet, label_token_ids
from evaluation.data import load_gsm8k, load_mbpp_plus
from evaluation.domains import domain_contexts
from evaluation.evalplus_score import score_mbpp_plus
from evaluation.generate import _eos_ids, extract_code, generate, truncate_after, truncate_at_stop
from evaluation.kl import RetainedKL, kl_per_position
from evaluation.prompts import code_message, math_message, render
from evaluation.tasks import csqa_choice_prompts
from flows import load_release

LINE = "smollm2-135m.assistant"
CODE_STOP, MATH_STOP = ("\n```\n",), ("\nQuestion:",)


class _StopAfter(StoppingCriteria):
    """The previous stop_after check: every row's whole new text decoded at every step."""

    def __init__(self, tokenizer, pattern: re.Pattern[str], width: int):
        self.tokenizer, self.pattern, self.width = tokenizer, pattern, width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.width :], skip_special_tokens=True)
        return torch.tensor([self.pattern.search(t) is not None for t in texts], device=input_ids.device)


@torch.inference_mode()
def previous_generate(model, tokenizer, prompts, max_new_tokens, batch_size=8, stop=(), stop_after=None):
    """The implementation before evaluation.generate's own loop, kept as the baseline."""
    eos = _eos_ids(model, tokenizer)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        stop_strings=list(stop) or None,
    )
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    outputs = [""] * len(prompts)
    saved, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False)
            width = enc["input_ids"].shape[1]
            criteria = StoppingCriteriaList([_StopAfter(tokenizer, stop_after, width)] if stop_after else [])
            out = model.generate(
                **enc, generation_config=config, tokenizer=tokenizer if stop else None, stopping_criteria=criteria
            )
            for i, text in zip(idx, tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)):
                outputs[i] = truncate_after(truncate_at_stop(text, stop), stop_after)
    finally:
        tokenizer.padding_side = saved
    return outputs


@torch.inference_mode()
def previous_choose(model, tokenizer, prompts, batch_size=8) -> list[str]:
    """CSQA choice before ChoiceSet: full forwards, the LM head fed transformers' strided last-position
    slice (torch's CPU linear then copies the whole head weight per row)."""
    label_ids = torch.tensor(label_token_ids(tokenizer))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    logprobs = torch.empty(len(prompts), len(label_ids))
    saved, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False)
            positions = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
            logits = model(**enc, position_ids=positions, logits_to_keep=1).logits[:, -1, :].float()
            logprobs[idx] = torch.log_softmax(logits, dim=-1)[:, label_ids]
    finally:
        tokenizer.padding_side = saved
    return logprobs


@torch.no_grad()
def previous_kl(kl: RetainedKL, reference: list[torch.Tensor], residual=None) -> float:
    """Retained KL before kl_many: per reference, every batch's whole (B, T, V) logits of the
    candidate and of the reference, padding included."""
    total = 0.0
    for i, (_, mask) in enumerate(kl.batches):
        logits = head_logits(kl.model, kl._upper(i, residual))
        total += float((kl_per_position(head_logits(kl.model, reference[i]), logits).cpu() * mask).sum())
    return total / kl.positions


def answers(model, tokenizer, fast: bool) -> tuple[dict, dict]:
    """({set: per-question answers}, {set: seconds}) for MBPP+ (pass/fail) and GSM8K (final numbers)."""
    problems, math = load_mbpp_plus("test").select(range(32)), load_gsm8k("test").select(range(16))
    code_prompts = [render(tokenizer, code_message(p["text"], p["first_test"]), "code") for p in problems]
    math_prompts = [render(tokenizer, math_message(q), "math") for q in math["question"]]
    run = (
        (lambda p, n, b, **kw: generate(model, tokenizer, p, n, b, progress=False, **kw))
        if fast
        else (lambda p, n, b, **kw: previous_generate(model, tokenizer, p, n, 8, **kw))
    )
    got, seconds = {}, {}
    start = time.perf_counter()
    code = run(code_prompts, 256, 32, stop=CODE_STOP)
    result = score_mbpp_plus({p["task_id"]: extract_code(c, p["entry_point"]) for p, c in zip(problems, code)})
    seconds["MBPP+ 32 (with EvalPlus)"] = time.perf_counter() - start
    got["MBPP+ texts"], got["MBPP+ pass/fail"] = code, [r.passed for r in result.problems]
    start = time.perf_counter()
    texts = run(math_prompts, 128, 16, stop=MATH_STOP, stop_after=ANSWER_GIVEN)
    seconds["GSM8K 16"] = time.perf_counter() - start
    got["GSM8K texts"], got["GSM8K final answers"] = texts, [extract_gsm8k_answer(t) for t in texts]
    return got, seconds


def references(kl: RetainedKL, model, chains) -> list[list[torch.Tensor]]:
    """Each reference version's final hidden states (the same list object for equal versions)."""
    out = {}
    for chain in chains:
        if id(chain) not in out:
            with chain.attached(model):
                out[id(chain)] = kl.reference(None)
    return [out[id(c)] for c in chains]


def retained_kl(model, tokenizer, candidate, refs, contexts: int, layer: int) -> tuple[dict, float]:
    """{(domain, previous|current): seconds} and the largest relative KL difference."""
    seconds, diff = {}, 0.0
    for domain in ("gsm8k", "csqa"):
        kl = RetainedKL(
            model,
            tokenizer,
            domain_contexts(tokenizer, domain, "gate", contexts)[1],
            layer,
            max_length=1024,
            progress=False,
        )
        kl.prefix()
        ref_states = references(kl, model, refs)
        with candidate.attached(model):
            start = time.perf_counter()
            previous = [previous_kl(kl, r) for r in ref_states]
            mid = time.perf_counter()
            current = [r.mean for r in kl.kl_many(ref_states, None)]
            seconds[domain, "previous"], seconds[domain, "current"] = mid - start, time.perf_counter() - mid
        diff = max([diff] + [abs(a - b) / max(abs(a), 1e-30) for a, b in zip(previous, current)])
    return seconds, diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--answers-only", action="store_true", help="generation only (e.g. the fp32 identity check)")
    args = ap.parse_args()

    v2 = load_release(LINE, "champion", dtype=args.dtype)
    model, tokenizer = v2.model, v2.tokenizer
    v2.detach()
    from atlas_core.chain import Chain

    base, v1 = Chain([]), Chain(v2.chain.deltas[:1])
    layer = v2.chain.lowest_layer - 1  # where the cycle's prefix cache ends: below every delta
    print(f"# {machine()}, dtype {model.dtype}; candidates {v2.manifest['chain'][0]['name']} (v1) and {v2.name} (v2)")
    prompts = csqa_choice_prompts(tokenizer, "validation", 128)[1]
    prefixed = ChoiceSet(model, tokenizer, prompts, batch_size=8, layer=layer)
    start = time.perf_counter()
    prefixed.prefix()  # nothing attached yet: the base model's states, as Resources.choice_set stores them
    print(f"# CSQA choice prefix states (once per line and prompt set): {time.perf_counter() - start:.1f} s")
    for case, candidate, refs in (("base", base, None), ("v1", v1, [base, base]), ("v2", v2.chain, [base, v1])):
        kl_too = refs is not None and not args.answers_only  # the base: its answers only (its KL is 0)
        with candidate.attached(model):
            old, t_old = answers(model, tokenizer, fast=False)
            new, t_new = answers(model, tokenizer, fast=True)
            if kl_too:
                start = time.perf_counter()
                choice_old = previous_choose(model, tokenizer, prompts)
                mid = time.perf_counter()
                choice_new = prefixed.choose()
                t_choice = (mid - start, time.perf_counter() - mid)
        print(f"\n## {case}\n\n| part | previous s | current s | ratio |\n|---|---|---|---|")
        for part in t_old:
            print(f"| {part} | {t_old[part]:.1f} | {t_new[part]:.1f} | {t_old[part] / t_new[part]:.2f}x |")
        total_old, total_new = sum(t_old.values()), sum(t_new.values())
        if kl_too:
            kl_s, kl_diff = retained_kl(model, tokenizer, candidate, refs, args.contexts, layer)
            for domain in ("gsm8k", "csqa"):
                p, c = kl_s[domain, "previous"], kl_s[domain, "current"]
                print(
                    f"| retained KL {domain} ({args.contexts} contexts, 2 references) "
                    f"| {p:.1f} | {c:.1f} | {p / c:.2f}x |"
                )
                total_old, total_new = total_old + p, total_new + c
            p, c = t_choice
            print(f"| CSQA choice 128 | {p:.1f} | {c:.1f} | {p / c:.2f}x |")
            total_old, total_new = total_old + p, total_new + c
        print(f"| **the whole evaluation** | {total_old:.1f} | {total_new:.1f} | **{total_old / total_new:.2f}x** |\n")
        summary = [f"{total_old:.1f} -> {total_new:.1f} s ({total_old / total_new:.2f}x)"]
        for key in old:
            n = sum(a != b for a, b in zip(old[key], new[key]))
            counts = f" (true: previous {sum(old[key])}, current {sum(new[key])})" if key.endswith("pass/fail") else ""
            print(f"- {key}: {n} of {len(old[key])} differ{counts}")
        if kl_too:
            print(f"- retained KL: largest relative difference {kl_diff:.1e}")
            moved = int((choice_old.argmax(-1) != choice_new.logprobs.argmax(-1)).sum())
            gap = float((choice_old - choice_new.logprobs).abs().max())
            print(f"- CSQA choices: {moved} of {len(prompts)} differ; largest label log-prob difference {gap:.1e}")
            summary.append(f"KL within {kl_diff:.1e} relative, {moved} choices differ")
            reading(
                f"one candidate's whole evaluation, the main job's {case}",
                "; ".join(summary),
                ">= 2x, same numbers (bf16 answers move with the batch: see the section)",
                "yes" if total_old / total_new >= 2 and moved == 0 and kl_diff < 1e-4 else "**no**",
            )


if __name__ == "__main__":
    main()
