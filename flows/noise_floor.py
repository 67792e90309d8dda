"""The flip noise floor: how many of its own answers the champion changes under a setting that
should not matter.

Greedy decoding is not bit-stable across batchings: padding and GEMM shapes change the order
of floating-point sums, and a near-tie between two tokens can go either way. Measured on
SmolLM2 in bf16 (bench/eval_candidate.py), decoding the *same* model in another batching
changed 5-8 of 16 GSM8K final answers. A candidate's negative flips F against the champion
therefore hold some flips no update caused.

The floor: the champion's answers on the gate's answered questions (GSM8K, CSQA) decoded again
in another batching (half the configured batch size, 2 when it is 1; CSQA by whole forwards,
without the shared prefix states), compared with its answers in the gate's own batching: F/G/W
of the champion against itself. They are stored as the champion's answers under
`<dataset>#b<batch>` in the ledger, so each champion is re-decoded once; every candidate's gate
detail and report show the floor beside its own F/G/W. In fp32 the floor is expected to be zero.
Half the batch rather than one question at a time: on SmolLM2 (CPU) batch 1 took 7x as long as
the gate's own GSM8K decoding (150 s against 22 s for 16 questions) and measures the same noise.

With `nfr.above_floor: true` the NFR bound is computed on max(F - F_floor, 0): flips above the
floor. That is a correction, not an exact statistic (the floor is itself one draw of the
noise), so it is off by default.
"""

from __future__ import annotations

from registry import Flips

from .answers import answer_sets, flips, version_answers
from .cycle import CycleContext
from .policy import ANSWERED
from .resources import Resources


def floor_batch(configured: int) -> int:
    """The other batching: half the configured batch size, or 2 when it is 1."""
    return configured // 2 if configured > 1 else 2


def flip_floor(res: Resources, ctx: CycleContext, champion_answers: dict) -> dict[str, Flips]:
    """Per answered domain the cycle watches: the champion's flips (its answers in the gate's
    batching, `champion_answers`: kind -> answers) against its own answers decoded again in another
    batching (stored in the ledger: generated once per champion)."""

    r = ctx.config.retained
    configured = {"gsm8k": r.generation_batch_size, "csqa": r.batch_size}
    datasets = answer_sets(res, ctx)
    out = {}
    for kind in (k for k in ANSWERED if k in champion_answers):
        usual, batch = champion_answers[kind], floor_batch(configured[kind])
        again = version_answers(ctx, ctx.champion, kind, f"{datasets[kind]}#b{batch}", list(usual), batch_size=batch)
        out[kind] = flips(usual, again)
    return out
