"""Two cycles of one line at once, in two processes, on a PostgreSQL ledger (a shared store and
MLflow database beside it): both train on the same champion, at most one of them moves it per
champion it measured against, the other reports `not-promoted`; afterwards the line keeps every
invariant of tests/test_line_sequences.py and the next cycle builds on the winner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest_registry import PG_HOST, PG_PORT, _admin, postgres_user
from tests.test_line_sequences import Line, _open, check_line

REPO = Path(__file__).resolve().parent.parent
CYCLE = (
    "import json, sys; from flows.update import update\n"
    "print('RESULT ' + json.dumps(update(sys.argv[1], sys.argv[2]).to_dict()))"
)


@pytest.fixture
def postgres_ledger(monkeypatch):
    user, why = postgres_user()
    if user is None:
        pytest.skip(why)
    name = f"line_test_{uuid.uuid4().hex[:12]}"
    _admin(user, f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://{user}@{PG_HOST}:{PG_PORT}/{name}"
    monkeypatch.setenv("ATLAS_LEDGER_URL", url)
    try:
        yield url
    finally:
        _admin(user, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _start(line: Line, skill: str, prefect_home: Path) -> subprocess.Popen:
    env = os.environ | {"PREFECT_HOME": str(prefect_home), "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)  # each process its own temporary Prefect server, as two hosts would have
    return subprocess.Popen(
        [sys.executable, "-c", CYCLE, line.config[skill], line.policies[False]],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=600)
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"a concurrent cycle failed (exit {proc.returncode}):\n{out[-4000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_two_cycles_of_one_line_at_once_on_postgres(prefect_harness, state, postgres_ledger, tmp_path):
    with pytest.MonkeyPatch.context() as patches:
        line = Line(tmp_path / "line", state, patches)
        line.run(("cycle", "a"))
        first = line.champion_of(line.current_line())
        assert first is not None

        procs = {skill: _start(line, skill, tmp_path / f"prefect-{skill}") for skill in ("b", "c")}
        results = {skill: _result(proc) for skill, proc in procs.items()}
        outcomes = sorted(r["outcome"] for r in results.values())
        assert outcomes in (["not-promoted", "promoted"], ["promoted", "promoted"]), results
        for r in results.values():  # whoever lost measured against the first champion and did not move it
            assert r["previous_champion"] == first.name or r["outcome"] == "promoted"
        line.check()

        winner = line.champion_of(line.current_line())
        loser = next((s for s, r in results.items() if r["outcome"] == "not-promoted"), None)
        if loser is not None:  # the loser's skill again: now on top of the winner
            line.run(("cycle", loser))
            p = _open()
            try:
                from registry import version_chain

                chain = [v.skill for v in version_chain(p.ledger, line.champion_of(line.current_line()).id)]
                assert chain[:2] == ["a", winner.skill] and chain[-1] == loser
                check_line(p, line.current_line(), loads=True)
            finally:
                p.close()
