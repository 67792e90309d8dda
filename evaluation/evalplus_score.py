"""MBPP+ pass@1 (greedy: one solution per problem) scored by EvalPlus 0.3.1, offline.

    result = score_mbpp_plus({"Mbpp/11": code, ...}, results_path="run/evalplus.json")
    result.solved, result.percent, result.base_solved, result.problems[0].plus_passed

How it runs:
- The problems are a filtered copy of the verified MbppPlus-v0.2.0.jsonl holding exactly the
  scored task ids (EvalPlus asserts that every problem in its data file has a sample).
- EvalPlus runs in a child process (`evaluation.evalplus_worker`) whose environment sets
  MBPP_OVERRIDE_PATH to that copy, XDG_CACHE_HOME to the ground-truth cache folder and
  EVALPLUS_MAX_MEMORY_BYTES (8 GiB). evalplus reads these at import, so each subset needs
  its own process; the child also isolates the run. EVALPLUS_TIMEOUT_PER_TASK is removed
  from the child's environment: evalplus 0.3.1 compares it as a string with a float and
  crashes when it is set.
- Generated code runs only inside EvalPlus's checker (a per-problem process with time
  limits, the memory limit and destructive os/shutil/subprocess calls disabled). EvalPlus
  documents that this guard is not a security sandbox; run untrusted models in a container.
- Ground truth is cached by EvalPlus as `<cache>/evalplus/<md5 of the problems file>.pkl`,
  so the same subset reuses it across runs (all 224 test problems: ~15 s to build, ~750 MB).
- Every run writes its samples to a fresh temporary folder, so EvalPlus never finds and
  silently reuses an old `*_eval_results.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from atlas_core.io import atomic_write_json
from atlas_core.paths import PROJECT_ROOT, state_dir
from evaluation.data import mbpp_plus_lines

MEMORY_LIMIT_BYTES = 8 * 1024**3


class EvalPlusError(RuntimeError):
    """EvalPlus did not produce a complete, matching result."""


@dataclass(frozen=True)
class ProblemResult:
    task_id: str
    passed: bool  # base AND plus tests
    base_passed: bool
    base_status: str  # "pass" / "fail" / "timeout"
    plus_status: str | None


@dataclass(frozen=True)
class EvalPlusResult:
    n: int
    solved: int  # passes base and plus tests
    base_solved: int  # passes base tests
    percent: float
    base_percent: float
    problems: list[ProblemResult]
    dataset_md5: str  # EvalPlus's hash of the problems file (its ground-truth cache key)
    seconds: float

    def solved_ids(self) -> list[str]:
        return [p.task_id for p in self.problems if p.passed]

    def to_json(self) -> dict:
        return asdict(self)


def evalplus_cache_home() -> Path:
    """XDG_CACHE_HOME for EvalPlus; it keeps its ground truth in `<this>/evalplus/`."""
    return state_dir() / "evalplus_cache"


def _task_number(task_id: str) -> int:
    return int(task_id.split("/")[1])


def score_mbpp_plus(
    solutions: Mapping[str, str],
    results_path: str | Path | None = None,
    cache_home: str | Path | None = None,
    memory_limit_bytes: int = MEMORY_LIMIT_BYTES,
    timeout_s: float | None = None,
) -> EvalPlusResult:
    """Score one complete solution (code string) per MBPP+ task id ("Mbpp/N").

    `results_path`: where to write the result with per-problem pass/fail (JSON).
    `cache_home`: XDG cache folder for EvalPlus (default `<state>/evalplus_cache`).
    `timeout_s`: wall-clock limit for the whole EvalPlus run (None: no limit)."""
    if not solutions:
        raise ValueError("no solutions to score")
    bad = [k for k, v in solutions.items() if not isinstance(v, str)]
    if bad:
        raise TypeError(f"solutions must be code strings; not for {bad[:3]}")
    lines = mbpp_plus_lines(sorted(solutions, key=_task_number))  # verified file; raises on unknown ids
    cache_home = Path(cache_home) if cache_home is not None else evalplus_cache_home()
    cache_home.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="evalplus_run_", dir=state_dir()) as tmp:
        run_dir = Path(tmp)
        problems_file = run_dir / "MbppPlus-subset.jsonl"
        problems_file.write_text("".join(lines))
        samples_file = run_dir / "samples.jsonl"
        samples_file.write_text(
            "".join(json.dumps({"task_id": t, "solution": code}) + "\n" for t, code in solutions.items())
        )
        raw = _run_worker(samples_file, problems_file, cache_home, memory_limit_bytes, timeout_s, run_dir)
        expected_md5 = _md5(problems_file)
    result = _parse(raw, list(solutions), expected_md5, time.monotonic() - started)
    if results_path is not None:
        atomic_write_json(results_path, result.to_json())
    return result


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _run_worker(
    samples: Path, problems: Path, cache_home: Path, memory: int, timeout_s: float | None, run_dir: Path
) -> dict:
    env = dict(os.environ)
    env.pop("EVALPLUS_TIMEOUT_PER_TASK", None)
    env.update(
        MBPP_OVERRIDE_PATH=str(problems),
        XDG_CACHE_HOME=str(cache_home),
        EVALPLUS_MAX_MEMORY_BYTES=str(memory),
        PYTHONPATH=os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")])),
        TOKENIZERS_PARALLELISM="false",
    )
    log_path = run_dir / "evalplus.log"
    with open(log_path, "w") as log:
        # Own session: on timeout the whole tree (worker + checker children) is killed together.
        proc = subprocess.Popen(
            [sys.executable, "-m", "evaluation.evalplus_worker", str(samples)],
            cwd=run_dir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise EvalPlusError(f"EvalPlus run exceeded {timeout_s} s and was killed; log tail:\n{_tail(log_path)}")
    results_file = samples.with_name("samples_eval_results.json")
    if code != 0 or not results_file.is_file():
        raise EvalPlusError(f"EvalPlus exited with code {code}; log tail:\n{_tail(log_path)}")
    return json.loads(results_file.read_text())


def _tail(path: Path, chars: int = 3000) -> str:
    text = path.read_text(errors="replace")
    return text[-chars:]


def _parse(raw: dict, task_ids: list[str], expected_md5: str, seconds: float) -> EvalPlusResult:
    if raw.get("hash") != expected_md5:
        raise EvalPlusError(f"EvalPlus scored data with hash {raw.get('hash')}, expected {expected_md5}")
    evals = raw.get("eval", {})
    if set(evals) != set(task_ids):
        raise EvalPlusError(f"EvalPlus returned {len(evals)} problems for {len(task_ids)} solutions")
    problems = []
    for task_id in sorted(task_ids, key=_task_number):
        (entry,) = evals[task_id]  # greedy: exactly one sample per problem
        base_ok = entry["base_status"] == "pass"
        problems.append(
            ProblemResult(
                task_id, base_ok and entry["plus_status"] == "pass", base_ok, entry["base_status"], entry["plus_status"]
            )
        )
    n = len(problems)
    solved = sum(p.passed for p in problems)
    base_solved = sum(p.base_passed for p in problems)
    return EvalPlusResult(
        n, solved, base_solved, 100.0 * solved / n, 100.0 * base_solved / n, problems, expected_md5, round(seconds, 2)
    )


def clear_cache(cache_home: str | Path | None = None) -> None:
    """Delete EvalPlus's ground-truth cache (it is rebuilt on the next run)."""
    shutil.rmtree(Path(cache_home or evalplus_cache_home()) / "evalplus", ignore_errors=True)
