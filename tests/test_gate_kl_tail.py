"""Retained KL beyond the mean (flows/kl_tail.py): p95 / p99 / max over a member's contexts against a
hand computation, the contexts that moved most, the optional policy limits (pass, reject, fail closed
on an evaluation stored without tails), and the evaluation's `extra` read back by stored_metrics.
The tiny cycle's records, report table and MLflow table are checked in test_flows_cycle.py."""

from __future__ import annotations

import json
import math

import pytest

from atlas_core.typed_config import ConfigError, build
from flows import kl_tail
from flows.gates import passed, run_checks
from flows.kl_tail import KLTail, MovedContext
from flows.metrics import CandidateMetrics, Regression
from flows.policy import ReleasePolicy, load_policy
from registry import Flips
from tests.flows_fixtures import PASSING_POLICY, stored_metrics_from, write_yaml

DOMAINS = ["gsm8k", "csqa"]
# csqa's five contexts; sorted 0.1 0.2 0.3 0.4 0.9, token-weighted mean somewhere near 0.38
PER_CONTEXT = [0.1, 0.4, 0.2, 0.9, 0.3]
TEXTS = ["first  question\nand   its answer", "second", "third", "fourth: " + "x" * 200, "fifth"]


def test_p95_p99_and_max_match_a_hand_computation():
    # Linear interpolation: h = (n - 1) q over the sorted values, x_floor(h) + frac(h) (x_next - x_floor(h)).
    p95 = 0.4 + (4 * 0.95 - 3) * (0.9 - 0.4)  # h = 3.8: 0.8
    p99 = 0.4 + (4 * 0.99 - 3) * (0.9 - 0.4)  # h = 3.96: 0.88
    t = kl_tail.tail(PER_CONTEXT)
    assert t == KLTail(pytest.approx(p95), pytest.approx(p99), 0.9, 5)
    assert t.p95 == pytest.approx(0.8) and t.p99 == pytest.approx(0.88)
    assert kl_tail.quantile([0.25], 0.95) == 0.25 and kl_tail.quantile([0.0, 1.0], 0.5) == 0.5
    assert kl_tail.quantile([3.0, 1.0, 2.0], 1.0) == 3.0  # q = 1 is the max
    # Nothing to compute on, or a non-finite context: NaN, which the gate rejects.
    for values in ([], [0.1, math.nan], [0.1, math.inf], [0.1, None]):
        assert math.isnan(kl_tail.quantile(values, 0.95)), values
        assert all(math.isnan(v) for v in (kl_tail.tail(values).p95, kl_tail.tail(values).max)), values


def test_the_contexts_that_moved_most_come_first_with_their_index_and_text():
    top = kl_tail.most_moved(PER_CONTEXT, TEXTS, k=3)
    assert [(c.index, c.kl) for c in top] == [(3, 0.9), (1, 0.4), (4, 0.3)]
    assert (
        len(top[0].text) == kl_tail.SNIPPET_CHARS and top[0].text.startswith("fourth: xxx") and top[0].text[-1] == "…"
    )
    assert kl_tail.snippet(TEXTS[0]) == "first question and its answer"  # one line, whitespace collapsed
    # What every context of a member begins with (the chat template, the instruction) is left out, by whole words.
    prompts = ["<s>Solve this. Question: What is 2+2?", "<s>Solve this. Question: Where is x?", "<s>Solve this. Q"]
    assert [c.text for c in kl_tail.most_moved([0.3, 0.2, 0.1], prompts)] == [
        "…Question: What is 2+2?",
        "…Question: Where is x?",
        "…Q",
    ]
    assert [c.index for c in kl_tail.most_moved([0.5, math.nan, 0.5], ["a", "b", "c"])] == [
        1,
        0,
        2,
    ]  # NaN first; ties by index
    tails, moved = kl_tail.summarise(
        {"vs_champion": {"csqa": PER_CONTEXT}, "vs_base": {"csqa": [0.0] * 5}}, lambda member: TEXTS
    )
    assert tails["vs_champion"]["csqa"] == kl_tail.tail(PER_CONTEXT) and tails["vs_base"]["csqa"].max == 0.0
    assert len(moved["vs_champion"]["csqa"]) == kl_tail.TOP_K == 5 and moved["vs_champion"]["csqa"][0].index == 3
    rows = kl_tail.rows(moved)
    assert rows[0] == {
        "against": "vs_champion",
        "member": "csqa",
        "rank": 1,
        "context": 3,
        "kl": 0.9,
        "text": moved["vs_champion"]["csqa"][0].text,
    }
    assert [r["against"] for r in rows] == ["vs_champion"] * 5 + ["vs_base"] * 5


# ------------------------------------------------------------------------ the gate
def policy(**changes) -> ReleasePolicy:
    return build(
        ReleasePolicy,
        PASSING_POLICY | {"max_kl_vs_champion": PASSING_POLICY["max_kl_vs_champion"] | {"released": 50.0}} | changes,
    )


def candidate(csqa_p95: float = 0.05, **changes) -> CandidateMetrics:
    tails = {
        "vs_champion": {
            "csqa": KLTail(csqa_p95, 0.3, 0.4, 128),
            "gsm8k": KLTail(0.1, 0.2, 0.3, 128),
            "code": KLTail(0.2, 0.5, 0.6, 32),
        },
        "vs_base": {"csqa": KLTail(0.1, 0.2, 0.3, 128), "gsm8k": KLTail(0.1, 0.2, 0.3, 128)},
    }
    base = dict(
        version_id=7,
        name="v7",
        method="atlas",
        seed=0,
        epoch=2,
        step=8,
        target_solved=3,
        target_total=8,
        champion_solved=2,
        kl_vs_base={"gsm8k": 0.02, "csqa": 0.03},
        kl_vs_champion={"gsm8k": 0.01, "csqa": 0.02, "code": 0.01},
        flips_vs_base={"gsm8k": Flips(20, 0, 1, 1), "csqa": Flips(40, 1, 2, 0)},
        flips_vs_champion={"gsm8k": Flips(20, 0, 0, 1), "csqa": Flips(40, 0, 1, 0)},
        csqa_choice_churn=0.025,
        released={"code": Regression(64, 30.0, 30.0, 0.0, 0.0, "pass-fail", 0, 0)},
        target_score=3.0,
        champion_score=2.0,
        kl_tail=tails,
    )
    return CandidateMetrics(**(base | changes))


def checks_of(c: CandidateMetrics, p: ReleasePolicy) -> dict:
    return {ch.name: ch for ch in run_checks(c, p, DOMAINS)}


def test_a_p95_limit_rejects_a_candidate_above_it_and_passes_one_below():
    p = policy(max_kl_tail_vs_champion={"csqa": {"p95": 0.1}})
    below, above = checks_of(candidate(csqa_p95=0.08), p), checks_of(candidate(csqa_p95=0.12), p)
    assert below["kl_p95_vs_champion[csqa]"].passed and below["kl_p95_vs_champion[csqa]"].measured == 0.08
    assert "over 128 contexts" in below["kl_p95_vs_champion[csqa]"].detail
    assert passed(list(below.values()))
    assert not above["kl_p95_vs_champion[csqa]"].passed and above["kl_p95_vs_champion[csqa]"].threshold == 0.1
    assert not passed(list(above.values()))
    assert not any(name.startswith("kl_p") or name.startswith("kl_max") for name in checks_of(candidate(), policy()))


def test_released_limits_apply_to_released_skills_and_base_limits_to_domains():
    p = policy(
        max_kl_tail_vs_champion={"released": {"max": 0.5}, "gsm8k": {"p99": 0.25}, "mbpp": {"max": 0.0}},
        max_kl_tail_vs_base={"csqa": {"p95": 0.2, "max": 0.25}},
    )
    checks = checks_of(candidate(), p)
    assert {n: c.passed for n, c in checks.items() if n.startswith(("kl_p", "kl_max"))} == {
        "kl_p99_vs_champion[gsm8k]": True,
        "kl_max_vs_champion[code]": False,  # 0.6 > 0.5
        "kl_p95_vs_base[csqa]": True,
        "kl_max_vs_base[csqa]": False,
    }  # mbpp is not watched by this cycle
    named = policy(max_kl_tail_vs_champion={"released": {"max": 0.5}, "code": {"max": 0.7}})
    assert checks_of(candidate(), named)["kl_max_vs_champion[code]"].passed  # its own limit wins


@pytest.mark.parametrize(
    "tails",
    [
        {},
        {"vs_champion": {}},
        {"vs_champion": {"csqa": KLTail(math.nan, 0.1, 0.1, 8)}},
        {"vs_champion": {"csqa": KLTail(None, None, None, 0)}},
        {"vs_champion": {"csqa": KLTail(-0.5, 0.1, 0.1, 8)}},
    ],
)
def test_a_tail_not_measured_or_impossible_fails_closed(tails):
    check = checks_of(candidate(kl_tail=tails), policy(max_kl_tail_vs_champion={"csqa": {"p95": 10.0}}))[
        "kl_p95_vs_champion[csqa]"
    ]
    assert not check.passed
    if not tails.get("vs_champion"):  # an evaluation stored before tails were kept
        assert check.measured is None and check.detail.startswith("missing: not measured")


def test_a_limit_on_response_positions_judges_the_answers_mean_alone():
    # The mean over all positions is low (a long shared prompt that barely moved), the answer's is not.
    split = KLTail(0.1, 0.2, 0.3, 128, prompt=0.001, response=0.04)
    c = candidate(kl_tail={"vs_champion": {"csqa": split}, "vs_base": {"gsm8k": KLTail(0.1, 0.2, 0.3, 128)}})
    checks = checks_of(c, policy(max_kl_tail_vs_champion={"csqa": {"response": 0.03, "prompt": 0.01}}))
    assert (
        not checks["kl_response_vs_champion[csqa]"].passed and checks["kl_response_vs_champion[csqa]"].measured == 0.04
    )
    assert checks["kl_prompt_vs_champion[csqa]"].passed
    assert checks_of(c, policy(max_kl_tail_vs_champion={"csqa": {"response": 0.05}}))[
        "kl_response_vs_champion[csqa]"
    ].passed
    # Not split (stored by older code, or measured without prompts): a limit on it fails closed.
    unsplit = checks_of(c, policy(max_kl_tail_vs_base={"gsm8k": {"response": 10.0}}))["kl_response_vs_base[gsm8k]"]
    assert not unsplit.passed and unsplit.measured is None


def test_the_gates_position_kinds_are_the_kls():
    from evaluation.kl import POSITION_KINDS

    assert kl_tail.POSITION_KINDS == POSITION_KINDS


@pytest.mark.parametrize(
    "field, limits, says",
    [
        (
            "max_kl_tail_vs_champion",
            {"csqa": {"p90": 0.1}},
            r"max_kl_tail_vs_champion.csqa.p90: unknown statistic; "
            r"expected one of \['p95', 'p99', 'max', 'prompt', 'response'\]",
        ),
        (
            "max_kl_tail_vs_champion",
            {"csqa": {"p95": -0.1}},
            "max_kl_tail_vs_champion.csqa.p95: expected a finite number >= 0",
        ),
        (
            "max_kl_tail_vs_base",
            {"gsm8k": {"max": math.inf}},
            "max_kl_tail_vs_base.gsm8k.max: expected a finite number",
        ),
        ("max_kl_tail_vs_base", {"gsm8k": {}}, "max_kl_tail_vs_base.gsm8k: expected a limit on at least one of"),
        (
            "max_kl_tail_vs_base",
            {"released": {"max": 1.0}},
            "max_kl_tail_vs_base.released: released skills are checked against the champion only",
        ),
        ("max_kl_tail_vs_champion", {"csqa": 0.1}, "max_kl_tail_vs_champion.csqa: expected a mapping"),
    ],
)
def test_a_bad_tail_limit_is_refused_in_one_line_naming_the_field(tmp_path, field, limits, says):
    path = write_yaml(tmp_path / "p.yaml", PASSING_POLICY | {field: limits})
    with pytest.raises(ConfigError, match=says) as e:
        load_policy(path, DOMAINS)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------ storage
def test_the_tails_round_trip_through_the_ledger_extra_and_stored_metrics(monkeypatch):
    from registry.rows import json_field

    tails = {
        "vs_champion": {
            "csqa": kl_tail.tail(PER_CONTEXT, {"prompt": 0.01, "response": 0.5}),
            "code": KLTail(math.nan, math.nan, math.inf, 4),
        },
        "vs_base": {"csqa": kl_tail.tail([0.0] * 5)},
    }
    moved = {
        "vs_champion": {
            "csqa": kl_tail.most_moved(PER_CONTEXT, TEXTS),
            "code": [MovedContext(2, math.nan, "def f():")],
        },
        "vs_base": {"csqa": kl_tail.most_moved([0.0] * 5, TEXTS, k=2)},
    }
    stored = json_field(kl_tail.to_extra(tails, moved), "extra")  # what the ledger accepts: no NaN/inf numbers
    extra = json.loads(json.dumps(stored, allow_nan=False)) | {"eval_key": "k"}
    found = stored_metrics_from(monkeypatch, extra)
    assert found.kl_tail["vs_champion"]["csqa"] == tails["vs_champion"]["csqa"]
    assert (found.kl_tail["vs_champion"]["csqa"].prompt, found.kl_tail["vs_champion"]["csqa"].response) == (0.01, 0.5)
    assert found.kl_tail["vs_base"] == tails["vs_base"] and found.kl_top_contexts["vs_base"] == moved["vs_base"]
    assert found.kl_top_contexts["vs_champion"]["csqa"] == moved["vs_champion"]["csqa"]
    code = found.kl_tail["vs_champion"]["code"]
    assert math.isnan(code.p95) and math.isnan(code.p99) and code.max == math.inf and code.contexts == 4
    assert math.isnan(found.kl_top_contexts["vs_champion"]["code"][0].kl)

    # An evaluation stored before tails were kept loads with none, and a tail limit then rejects it.
    for key in ("kl_tail", "kl_top_contexts"):
        del extra[key]
    old = stored_metrics_from(monkeypatch, extra)
    assert old is not None and old.kl_tail == {} and old.kl_top_contexts == {}
    check = {c.name: c for c in run_checks(old, policy(max_kl_tail_vs_champion={"csqa": {"max": 1.0}}), DOMAINS)}
    assert not check["kl_max_vs_champion[csqa]"].passed and check["kl_max_vs_champion[csqa]"].measured is None
