"""Retained KL of one candidate on the main job's subsets (128 GSM8K test + 128 CSQA validation
contexts, prefix cache below the deltas' layer): the previous implementation, one pass per reference, against
the current one, `RetainedKL.kl_many` (one pass of the candidate for all references, a reference
given twice measured once, the LM head on real positions only in chunks of 128), side by side
in one run, with the values compared.

Two cases, as the main job's two cycles meet them:
    v1's cycle  the champion is the base: KL vs base and vs champion use the same reference
    v2's cycle  the champion is v1: two references, one candidate pass
Candidates are the main job's releases (run `bash scripts/main.sh` first; ATLAS_STATE_DIR as there).
The candidate's answers (generation, EvalPlus, choice) are not touched by the change; their time
is taken from the main job's report ("Inside the stages") to give the whole evaluation's ratio.

    .venv/bin/python bench/eval_candidate.py [--contexts 128] [--dtype auto]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine  # noqa: E402
from evaluation.domains import domain_contexts  # noqa: E402
from atlas_core.backbone import head_logits  # noqa: E402
from evaluation.kl import RetainedKL, kl_per_position  # noqa: E402
from flows import load_release  # noqa: E402

LINE = "smollm2-135m.assistant"


@torch.no_grad()
def previous_kl(kl: RetainedKL, reference: list[torch.Tensor]) -> float:
    """The implementation before kl_many, kept as the baseline: per reference, every batch's
    whole (B, T, V) logits of the candidate and of the reference, padding included."""
    total = 0.0
    for i, (_, mask) in enumerate(kl.batches):
        logits = head_logits(kl.model, kl._upper(i, None))
        total += float((kl_per_position(head_logits(kl.model, reference[i]), logits).cpu() * mask).sum())
    return total / kl.positions


def references(kl: RetainedKL, model, chains) -> list[list[torch.Tensor]]:
    """Each reference version's final hidden states (the same list object for equal versions)."""
    out = {}
    for chain in chains:
        if id(chain) not in out:
            with chain.attached(model):
                out[id(chain)] = kl.reference(None)
    return [out[id(c)] for c in chains]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    v2 = load_release(LINE, "champion", dtype=args.dtype)
    v1_name = v2.manifest["chain"][0]["name"]
    model, tokenizer = v2.model, v2.tokenizer
    v2.detach()
    from atlas_core.chain import Chain

    base, v1, cand2 = Chain([]), Chain(v2.chain.deltas[:1]), v2.chain
    layer = v2.chain.lowest_layer - 1  # where the cycle's prefix cache ends: below every delta
    print(f"# {machine()}, dtype {model.dtype}; candidates {v1_name} and {v2.name}; {args.contexts} contexts a domain")
    print("| case | domain | previous s | current s | ratio | max relative difference of KL |")
    print("|---|---|---|---|---|---|")
    totals = {}
    for case, candidate, refs in (("v1's cycle (champion = base)", v1, [base, base]),
                                  ("v2's cycle (champion = v1)", cand2, [base, v1])):
        for domain in ("gsm8k", "csqa"):
            texts = domain_contexts(tokenizer, domain, "gate", args.contexts)[1]
            kl = RetainedKL(model, tokenizer, texts, layer, max_length=1024, progress=False)
            kl.prefix()
            ref_states = references(kl, model, refs)
            with candidate.attached(model):
                start = time.perf_counter()
                previous = [previous_kl(kl, r) for r in ref_states]  # one pass per reference, as before
                mid = time.perf_counter()
                current = [r.mean for r in kl.kl_many(ref_states, None)]
                end = time.perf_counter()
            diff = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(previous, current))
            t_prev, t_cur = mid - start, end - mid
            totals[case] = [x + y for x, y in zip(totals.get(case, [0.0, 0.0]), (t_prev, t_cur))]
            print(f"| {case} | {domain} | {t_prev:.1f} | {t_cur:.1f} | {t_prev / t_cur:.2f}x | {diff:.1e} |")
    for case, (p, c) in totals.items():
        print(f"| {case} | both | {p:.1f} | {c:.1f} | {p / c:.2f}x | |")


if __name__ == "__main__":
    main()
