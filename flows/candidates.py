"""run_candidates: every candidate of the policy (method x seed), trained and evaluated as one unit.

    candidate(ctx, method, seed)  -> list[int]           train (resume, or reuse) one delta, evaluate its versions
    run_candidates(ctx)           -> list[CandidateRun]   all of them, in the mode the config says, joined

The update config's `execution.candidates` chooses where candidates run:

- `in-process` (the embedded default): one after another in this process, sharing its loaded backbone
  and caches (the champion's and the base's answers are generated once, for the first candidate).
- `work-pool`: each as a flow run of the `candidate` deployment (deploy/prefect.yaml), created with
  `run_deployment` and picked up by the pool's workers (process or Kubernetes), all at once; each
  holds one slot of the global concurrency limit `execution.slots` (e.g. `gpu`) while it runs.
  A worker receives the candidate's inputs as JSON (CycleContext is plain values; ctx.platform
  names the ledger, artifact store and MLflow), so workers must share them with the cycle (a
  PostgreSQL ledger, a shared store). docs/FLOWS.md says why work pools rather than Dask or Ray.

Either way the gate joins the candidates' records from the ledger (their active versions and the
evaluations recorded for them), so it judges what was recorded, wherever it ran.

A candidate fails when its training or evaluation raises, its flow run crashes or is cancelled, or
(work pool) its flow run stops sending heartbeats for `execution.heartbeat_timeout_s` (its worker is
gone: the run is marked Crashed). It is recorded (a training run cut short: status failed, with the
reason; MLflow run FAILED with tag `atlas.failure`) and returned with the reason; the policy's
`candidates.require_all` says whether the gate then rejects the cycle or decides among the others.
A rerun reuses finished candidates by content key (training run and evaluation) and resumes a
killed training from its last checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from prefect import flow, get_run_logger

from atlas_core.errors import InputError

from .cycle import CycleContext
from .evaluate import evaluate_candidate, stored_metrics
from .metrics import CandidateMetrics
from .platform import subflows_without_heartbeats
from .resources import scope
from .training import failure_reason, train_candidate


@dataclass(frozen=True)
class CandidateRun:
    """What became of one candidate: its evaluated versions, or why it failed."""

    method: str
    seed: int
    metrics: tuple[CandidateMetrics, ...] = ()  # its active versions' recorded evaluations
    failure: Optional[str] = None  # None: finished

    @property
    def label(self) -> str:
        return f"{self.method} s{self.seed}"


@flow(name="candidate", validate_parameters=True)
def candidate(ctx: CycleContext, method: str, seed: int) -> list[int]:
    """One candidate: train (method, seed) on top of the champion and evaluate each of its active
    versions against the champion and the base, everything recorded; returns the version ids.
    In work-pool mode it holds one slot of `execution.slots` while it runs."""
    with scope(ctx.platform), _slot(ctx.config.execution), subflows_without_heartbeats():
        versions = [v for v in train_candidate(ctx, method, seed) if v != ctx.champion.version.id]
        for v in versions:
            evaluate_candidate(ctx, v)
        return versions


def run_candidates(ctx: CycleContext, lap: Callable[[str], None] = lambda phase: None) -> list[CandidateRun]:
    """Every candidate of the policy, in the configured mode, joined from the ledger; `lap(phase)` is
    called as each candidate ends (in-process) or when all have (work pool), to time the phases."""
    plans = [(m, s) for m in ctx.policy.candidates.methods for s in ctx.policy.candidates.seeds]
    if ctx.config.execution.candidates == "work-pool":
        failures = _on_work_pool(ctx, plans)
        lap(f"candidates on {ctx.config.execution.deployment} (train + evaluate, at once)")
    else:
        failures = {}
        for method, seed in plans:
            failures[(method, seed)] = _in_process(ctx, method, seed)
            lap(f"candidate {method} s{seed}")  # the first also answers the champion's and the base's questions
    from .skills import skill_set
    from .training import planned_runs

    keys = {(m, s): key for m, s, _, _, key in planned_runs(ctx, skill_set(ctx.skill))}  # the data hashed once
    return [_joined(ctx, m, s, keys[(m, s)], failures[(m, s)]) for m, s in plans]


def _in_process(ctx: CycleContext, method: str, seed: int) -> Optional[str]:
    """Run one candidate here; its failure reason, or None."""
    state = candidate(ctx, method, seed, return_state=True)
    if state.is_completed():
        return None
    try:
        state.result()
    except Exception as e:
        return failure_reason(e)
    return f"{state.name}: {state.message}"


def _joined(ctx: CycleContext, method: str, seed: int, key: str, failure: Optional[str]) -> CandidateRun:
    """The candidate's (run `key`) active versions and their recorded evaluations, read from the ledger; one
    without a recorded evaluation is a failure (nothing unrecorded reaches the gate)."""
    from registry import find_training_run, get_version

    from .training import candidate_versions, end_training_run

    with scope(ctx.platform) as res:
        db = res.ledger
        found = find_training_run(db, ctx.backbone.ledger_id, ctx.skill.name, method, seed, key, model_id=ctx.model.id)
        if failure is not None:
            if found is not None and found[1] == "running":  # cut short where nobody could record it (a killed worker)
                end_training_run(ctx.platform, found[0], "failed", failure)
            get_run_logger().warning(f"candidate {method} s{seed} failed: {failure}")
            return CandidateRun(method, seed, failure=failure)
        if found is None or found[1] != "finished":
            return CandidateRun(method, seed, failure=f"its training run is {found[1] if found else 'missing'}")
        metrics = []
        for version in (get_version(db, v) for v in candidate_versions(db, found[0], ctx.config.evaluate)):
            if version.status != "active" or version.id == ctx.champion.version.id:
                continue
            m = stored_metrics(db, ctx, version)
            if m is None:
                return CandidateRun(method, seed, failure=f"version {version.name} has no recorded evaluation")
            metrics.append(m)
        return CandidateRun(method, seed, tuple(metrics))


def _slot(execution):
    """One slot of the global concurrency limit `execution.slots` (work pool only), else nothing."""
    from contextlib import nullcontext

    if execution.candidates != "work-pool" or execution.slots is None:
        return nullcontext()
    from prefect.concurrency.sync import concurrency

    return concurrency(execution.slots, occupy=1, strict=True)


def require_work_pool(execution) -> None:
    """Before anything trains: the candidate deployment and the concurrency limit exist (work pool)."""
    if execution.candidates != "work-pool":
        return
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(execution.deployment)
        except ObjectNotFound:
            raise InputError(
                f"execution.deployment: no Prefect deployment {execution.deployment!r} "
                "(deploy flows/candidates.py:candidate, see deploy/prefect.yaml)"
            ) from None
        if execution.slots is not None:
            try:
                client.read_global_concurrency_limit_by_name(execution.slots)
            except ObjectNotFound:
                raise InputError(
                    f"execution.slots: no Prefect global concurrency limit {execution.slots!r} "
                    f"(create it: prefect gcl create {execution.slots} --limit N)"
                ) from None


def _on_work_pool(ctx: CycleContext, plans: list[tuple[str, int]]) -> dict[tuple[str, int], Optional[str]]:
    """Start every candidate as a flow run of the deployment, wait for all; failure reason per plan."""
    from prefect.deployments import run_deployment
    from pydantic import TypeAdapter

    log, ex = get_run_logger(), ctx.config.execution
    params = {"ctx": TypeAdapter(CycleContext).dump_python(ctx, mode="json")}
    runs = {}
    for method, seed in plans:
        run = run_deployment(
            ex.deployment,
            parameters=params | {"method": method, "seed": seed},
            timeout=0,  # start them all; wait below
            flow_run_name=f"{ctx.skill.name}-{method}-s{seed}",
            idempotency_key=f"{ctx.flow_run_id}:{method}:{seed}" if ctx.flow_run_id else None,
        )
        runs[(method, seed)] = run.id
        log.info(f"candidate {method} s{seed}: flow run {run.id} on {ex.deployment}")
    return _wait(runs, ex.heartbeat_timeout_s, ex.poll_seconds)


def _wait(runs: dict, heartbeat_timeout_s: float, poll_seconds: float) -> dict:
    """Poll the flow runs until every one is final. A running one whose newest heartbeat is older than
    `heartbeat_timeout_s` is marked Crashed: its worker is gone and nobody else will. A run that sent
    no heartbeat at all has them turned off (PREFECT_FLOWS_HEARTBEAT_FREQUENCY unset on its worker;
    the first is sent at its start) and is never judged by silence."""
    from prefect import get_client
    from prefect.states import Crashed

    out, pending = {}, dict(runs)
    with get_client(sync_client=True) as client:
        while pending:
            for plan, run_id in list(pending.items()):
                state = client.read_flow_run(run_id).state
                if state is not None and state.is_running():
                    beat = _newest_heartbeat(client, run_id, state.timestamp)
                    if beat is not None and time.time() - beat > heartbeat_timeout_s:
                        why = f"no heartbeat for {time.time() - beat:.0f} s: its worker is gone"
                        client.set_flow_run_state(run_id, Crashed(message=why), force=True)
                        out[plan] = f"flow run crashed: {why}"
                        del pending[plan]
                        continue
                if state is not None and state.is_final():
                    out[plan] = None if state.is_completed() else f"flow run {state.name.lower()}: {state.message}"
                    del pending[plan]
            if pending:
                time.sleep(poll_seconds)
    return out


def _newest_heartbeat(client, run_id, since) -> Optional[float]:
    """Epoch seconds of the flow run's newest heartbeat event since `since`; None if it sent none."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    events = client.read_events(
        EventFilter(
            occurred=EventOccurredFilter(since=since),
            event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
            resource=EventResourceFilter(id=[f"prefect.flow-run.{run_id}"]),
        ),
        limit=1,  # newest first
    ).events
    return events[0].occurred.timestamp() if events else None
