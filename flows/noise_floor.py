"""The flip noise floor: how many of its own answers the champion changes under a setting that
should not matter.

Greedy decoding is not bit-stable across batchings: padding and GEMM shapes change the order
of floating-point sums, and a near-tie between two tokens can go either way. Measured on
SmolLM2 in bf16 (bench/eval_candidate.py), decoding the *same* model in another batching
changed 5-8 of 16 GSM8K final answers. A candidate's negative flips F against the champion
therefore hold some flips no update caused.

The floor: the champion's answers on the gate's answered questions (GSM8K, CSQA) decoded again
one question at a time (batch size 1, whole forwards, no shared prefix states), compared with
its answers in the gate's own batching: F/G/W of the champion against itself. They are stored
as the champion's answers under `<dataset>#b1` in the ledger, so each champion is re-decoded
once; every candidate's gate detail and report show the floor beside its own F/G/W. In fp32
the floor is expected to be zero.

With `nfr.above_floor: true` the NFR bound is computed on max(F - F_floor, 0): flips above the
floor. That is a correction, not an exact statistic (the floor is itself one draw of the
noise), so it is off by default.
"""
from __future__ import annotations

from .cycle import CycleContext
from .gates import Flips

FLOOR_BATCH = 1
FLOOR_SUFFIX = f"#b{FLOOR_BATCH}"  # ledger dataset of the champion's re-decoded answers
FLOOR_KINDS = ("gsm8k", "csqa")  # the answered retained domains (NFR, churn)


def flip_floor(ctx: CycleContext) -> dict[str, Flips]:
    """Per answered domain the cycle watches: the champion's flips against its own answers
    decoded again at batch size 1 (answers stored in the ledger, generated once per champion)."""
    from .evaluate import answer_sets, flips, question_ids, version_answers

    out = {}
    for kind, dataset in answer_sets(ctx).items():
        if kind not in FLOOR_KINDS:
            continue
        ids = question_ids(ctx, kind)
        usual = version_answers(ctx, ctx.champion, kind, dataset, ids)
        again = version_answers(ctx, ctx.champion, kind, dataset + FLOOR_SUFFIX, ids, batch_size=FLOOR_BATCH)
        out[kind] = flips(usual, again)
    return out

