"""Where a version's retained KL sits: its mean over prompt positions and over answer positions.

Every retained context of a domain begins with the same chat template and instruction; the KL's mean
over all tokens mixes those prompt positions (states that have seen only the rendered prompt) with
the reference answer's (evaluation/kl.py). For each version of a line, against the base model, on a
retained domain's first N gating contexts, printed side by side:

    .venv/bin/python bench/kl_positions.py --model smollm2-135m.assistant \
        --versions smollm2-135m-code-atlas-s0-e2 smollm2-135m-code-weight-lora-s0-e2 [--domain gsm8k] [--contexts 128]

Run it on the state folder of a line (ATLAS_STATE_DIR), e.g. after `bash scripts/main.sh`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the line's registered model, e.g. smollm2-135m.assistant")
    parser.add_argument("--versions", nargs="+", required=True, help="version names (or champion)")
    parser.add_argument("--domain", default="gsm8k", choices=("gsm8k", "csqa", "mbpp"))
    parser.add_argument("--contexts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=1024)
    args = parser.parse_args()

    from evaluation.contexts import retained_prompts
    from evaluation.kl import RetainedKL
    from flows.platform import configure_environment
    from flows.serving import load_release

    configure_environment()
    base = load_release(args.model, "base")
    _, prompts, contexts = retained_prompts(base.tokenizer, args.domain, limit=args.contexts)

    def kl_set(model) -> RetainedKL:  # whole forwards: the versions' deltas may sit at any layer
        return RetainedKL(
            model, base.tokenizer, contexts, -1, max_length=args.max_tokens, progress=False, prompts=prompts
        )

    reference = kl_set(base.model).reference()
    print(f"machine: {machine()}")
    print(f"{args.model}: KL(base || version) on the first {len(contexts)} {args.domain} gating contexts, nats/token")
    print(f"{'version':48s} {'all':>9s} {'prompt':>9s} {'response':>9s} {'prompt share of the sum':>24s}")
    for name in args.versions:
        version = load_release(args.model, name)
        result = kl_set(version.model).kl(reference)
        prompt, response = result.by_kind["prompt"], result.by_kind["response"]
        total, prompt_sum = result.mean * result.positions, (prompt.mean or 0.0) * prompt.positions
        share = prompt_sum / total if total > 0 else float("nan")  # the base itself: 0 / 0
        means = " ".join(
            f"{m:9.5f}" if m is not None else f"{'-':>9s}" for m in (result.mean, prompt.mean, response.mean)
        )
        print(f"{version.name:48s} {means} {share:24.1%}")
        version.detach()
    print(f"positions: {prompt.positions:,} prompt, {response.positions:,} response (of {result.positions:,})")


if __name__ == "__main__":
    main()
