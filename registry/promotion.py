"""Promotion, rollback, re-nomination and repair of the aliases `champion` and `candidate`.

The ledger is the source of truth. An alias move is one ledger transaction (a release row
plus the new current holder), followed by the same move in MLflow. If the process dies in
between, the release stays marked unsynced and `repair` makes MLflow agree again;
repeating a promotion that already happened is a no-op apart from that re-sync.

Two promotions of the same model are serialised by locking the model's row (SELECT ...
FOR UPDATE on PostgreSQL; every SQLite transaction is BEGIN IMMEDIATE). Inside the lock a
promotion checks that the champion is still the version its gate decision was measured
against, so when two cycles race, the second finds a new champion and is refused.

A rollback moves `champion` to its previous holder, or to the base version when there was
none: nobody holding `champion` means the base backbone serves. The version rolled back is
retired, and no promotion to `champion` takes it again until a person re-nominates it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Union

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from registry.db import Ledger, LedgerError
from registry.lines import base_row, get_version, lock_line, version_info
from registry.mlflow_bridge import MANAGED_ALIASES, MlflowBridge
from registry.models import AliasHolder, GateDecision, ModelVersion, RegisteredModel, Release, utcnow
from registry.records import ReleaseInfo, VersionInfo


class PromotionError(Exception):
    """An alias could not be moved; nothing was changed in the ledger."""


class PromotionConflict(PromotionError):
    """The alias holder is not the one the caller (or its gate decision) expected."""


class GateNotPassed(PromotionError):
    pass


class RollbackError(PromotionError):
    pass


FROM_GATE = "from-gate"  # expect the champion the gate decision was measured against
ANY_HOLDER = "any-holder"  # move the alias whoever holds it (used for `candidate`)
Expected = Union[int, None, str]


def _release_info(row: Release) -> ReleaseInfo:
    return ReleaseInfo(
        row.id,
        row.registered_model_id,
        row.alias,
        row.model_version_id,
        row.previous_version_id,
        row.action,
        row.reason,
        row.flow_run_id,
        row.created_at,
        row.mlflow_synced_at is not None,
    )


def _passing_decision(session: Session, version_id: int) -> GateDecision:
    """The version's latest gate decision, which must be a pass (fail closed)."""
    decision = session.scalar(
        select(GateDecision)
        .where(GateDecision.model_version_id == version_id)
        .order_by(GateDecision.id.desc())
        .limit(1)
    )
    if decision is None:
        raise GateNotPassed(f"version id {version_id} has no gate decision; it cannot be promoted")
    if not decision.passed:
        raise GateNotPassed(
            f"version id {version_id} failed gate decision {decision.id} (policy {decision.policy_name!r})"
        )
    return decision


def _version_label(session: Session, version_id: Optional[int]) -> str:
    if version_id is None:
        return "nobody"
    row = session.get(ModelVersion, version_id)
    return f"{row.name} (id {row.id})"


def _record_release(
    session: Session,
    model_id: int,
    alias: str,
    version_id: int,
    previous: Optional[int],
    action: str,
    reason: str,
    flow_run_id: Optional[str],
) -> Release:
    release = Release(
        registered_model_id=model_id,
        alias=alias,
        model_version_id=version_id,
        previous_version_id=previous,
        action=action,
        reason=reason,
        flow_run_id=flow_run_id,
    )
    session.add(release)
    session.flush()
    return release


def _move_alias(
    session: Session,
    model_id: int,
    alias: str,
    version_id: int,
    previous: Optional[int],
    action: str,
    reason: str,
    flow_run_id: Optional[str],
) -> Release:
    release = _record_release(session, model_id, alias, version_id, previous, action, reason, flow_run_id)
    holder = session.get(AliasHolder, (model_id, alias))
    if holder is None:
        session.add(
            AliasHolder(registered_model_id=model_id, alias=alias, model_version_id=version_id, release_id=release.id)
        )
    else:
        holder.model_version_id = version_id
        holder.release_id = release.id
    return release


def _sync_to_mlflow(
    ledger: Ledger,
    bridge: Optional[MlflowBridge],
    model_name: str,
    alias: str,
    mlflow_version: Optional[str],
    release: ReleaseInfo,
) -> ReleaseInfo:
    """Move the MLflow alias like the ledger's; `mlflow_version` None: the base serves, so
    MLflow's alias is removed."""
    if bridge is None:
        return release  # ledger-only use; `repair` will bring MLflow along later
    if mlflow_version is not None:
        bridge.set_alias(model_name, alias, str(mlflow_version))
    elif alias in bridge.aliases(model_name):
        bridge.delete_alias(model_name, alias)
    with ledger.transaction() as s:
        s.execute(update(Release).where(Release.id == release.id).values(mlflow_synced_at=utcnow()))
    return replace(release, mlflow_synced=True)


def _retired_by(session: Session, version: ModelVersion) -> str:
    """How a retired version was retired, for the error that refuses to promote it."""
    release = session.scalar(
        select(Release)
        .where(Release.previous_version_id == version.id, Release.action == "rollback")
        .order_by(Release.id.desc())
        .limit(1)
    )
    return f"release #{release.id}: {release.reason}" if release else "no rollback release found"


def promote(
    ledger: Ledger,
    bridge: Optional[MlflowBridge],
    version_id: int,
    *,
    alias: str = "champion",
    reason: str = "",
    flow_run_id: Optional[str] = None,
    expected_current: Expected = FROM_GATE,
    require_gate: bool = True,
) -> ReleaseInfo:
    """Give `alias` to a version: ledger first (one transaction), then MLflow.

    `expected_current` is the version that must hold the alias right now: by default the
    champion recorded in the version's gate decision; an id, None (nobody), or ANY_HOLDER.
    Promoting the current holder again only re-syncs MLflow and returns its release.
    A version retired by a rollback cannot become `champion` until `renominate` is called.
    """
    if alias not in MANAGED_ALIASES:
        raise PromotionError(f"alias: expected one of {MANAGED_ALIASES}, got {alias!r}")
    version = get_version(ledger, version_id)
    if bridge is not None and version.mlflow_version is None:
        raise PromotionError(
            f"version {version.name} (id {version.id}) is not in MLflow yet; "
            "publish it (registry.publish_version) before promoting"
        )
    with ledger.transaction() as s:
        lock_line(s, version.model_id)
        holder = s.get(AliasHolder, (version.model_id, alias))
        current = holder.model_version_id if holder else None
        if current == version_id:
            release = s.get(Release, holder.release_id)
        else:
            row = s.get(ModelVersion, version_id)
            if alias == "champion" and row.status == "retired":
                raise PromotionError(
                    f"{version.name} (id {version.id}) was retired by rollback ({_retired_by(s, row)}); "
                    "re-nominate it with `atlas renominate` to make it promotable again"
                )
            decision = _passing_decision(s, version_id) if require_gate else None
            expected = expected_current
            if expected == FROM_GATE:
                if decision is None:
                    raise PromotionError("expected_current=FROM_GATE needs require_gate=True")
                expected = decision.release_version_id
            if expected != ANY_HOLDER and current != expected:
                raise PromotionConflict(
                    f"{alias} of {version.model_name} is held by {_version_label(s, current)}, but "
                    f"{version.name} was gated against {_version_label(s, expected)}; re-evaluate it "
                    "against the new release"
                )
            release = _move_alias(s, version.model_id, alias, version_id, current, "promote", reason, flow_run_id)
        info = _release_info(release)
    return _sync_to_mlflow(ledger, bridge, version.model_name, alias, version.mlflow_version, info)


def mark_candidate(
    ledger: Ledger, bridge: Optional[MlflowBridge], version_id: int, flow_run_id: Optional[str] = None
) -> ReleaseInfo:
    """Point `candidate` at the version under evaluation (no gate needed)."""
    return promote(
        ledger,
        bridge,
        version_id,
        alias="candidate",
        reason="under evaluation",
        flow_run_id=flow_run_id,
        expected_current=ANY_HOLDER,
        require_gate=False,
    )


def _rollback_target(session: Session, model_id: int, alias: str, current: int) -> Optional[int]:
    """Who held the alias before the current holder was last promoted."""
    promoted = session.scalar(
        select(Release)
        .where(
            Release.registered_model_id == model_id,
            Release.alias == alias,
            Release.model_version_id == current,
            Release.action == "promote",
        )
        .order_by(Release.id.desc())
        .limit(1)
    )
    return promoted.previous_version_id if promoted else None


def rollback(
    ledger: Ledger,
    bridge: Optional[MlflowBridge],
    model_id: int,
    reason: str,
    *,
    flow_run_id: Optional[str] = None,
    alias: str = "champion",
) -> ReleaseInfo:
    """Move `alias` back to the version that held it before the current one, or to the base
    version when nobody did; the version rolled back is retired. Records why."""
    if not reason or not reason.strip():
        raise RollbackError("rollback: a reason is required (it is recorded in the ledger)")
    with ledger.transaction() as s:
        model = lock_line(s, model_id)
        holder = s.get(AliasHolder, (model_id, alias))
        if holder is None:
            raise RollbackError(f"{model.name}: nobody holds {alias!r} (the base serves); nothing to roll back")
        current = holder.model_version_id
        target = _rollback_target(s, model_id, alias, current)
        if target is None:
            # Back to the bare backbone: the release names the base, and nobody holds the alias.
            release = _record_release(
                s, model_id, alias, base_row(s, model).id, current, "rollback", reason, flow_run_id
            )
            s.delete(holder)
            mlflow_version = None
        else:
            target_row = s.get(ModelVersion, target)
            if bridge is not None and target_row.mlflow_version is None:
                raise RollbackError(f"{_version_label(s, target)} is not in MLflow; publish it first")
            release = _move_alias(s, model_id, alias, target, current, "rollback", reason, flow_run_id)
            mlflow_version = target_row.mlflow_version
        rolled_back = s.get(ModelVersion, current)
        if rolled_back.checkpoint_id is not None:  # the base is the floor: it is never retired
            rolled_back.status = "retired"
        info = _release_info(release)
        model_name = model.name
    return _sync_to_mlflow(ledger, bridge, model_name, alias, mlflow_version, info)


def renominate(ledger: Ledger, version_id: int, reason: str, *, flow_run_id: Optional[str] = None) -> ReleaseInfo:
    """Make a version that a rollback retired promotable again; moves no alias.

    Recorded as a release with action 'renominate' (alias 'champion', previous = the
    current holder) so that the history shows who lifted the retirement and why.
    """
    if not reason or not reason.strip():
        raise PromotionError("renominate: a reason is required (it is recorded in the ledger)")
    with ledger.transaction() as s:
        version = s.get(ModelVersion, version_id)
        if version is None:
            raise LedgerError(f"model version id {version_id} does not exist in the ledger")
        lock_line(s, version.registered_model_id)
        if version.status != "retired":
            raise PromotionError(
                f"{version.name} (id {version.id}) is {version.status}, not retired; there is nothing to re-nominate"
            )
        version.status = "active"
        holder = s.get(AliasHolder, (version.registered_model_id, "champion"))
        release = _record_release(
            s,
            version.registered_model_id,
            "champion",
            version.id,
            holder.model_version_id if holder else None,
            "renominate",
            reason,
            flow_run_id,
        )
        release.mlflow_synced_at = utcnow()  # no alias moved: MLflow has nothing to catch up on
        return _release_info(release)


def alias_holder(ledger: Ledger, model_id: int, alias: str = "champion") -> Optional[VersionInfo]:
    with ledger.transaction() as s:
        holder = s.get(AliasHolder, (model_id, alias))
        return version_info(s, s.get(ModelVersion, holder.model_version_id)) if holder else None


def list_releases(ledger: Ledger, model_id: int, alias: Optional[str] = None) -> list[ReleaseInfo]:
    """Every alias move of a model, oldest first."""
    with ledger.transaction() as s:
        query = select(Release).where(Release.registered_model_id == model_id)
        if alias is not None:
            query = query.where(Release.alias == alias)
        return [_release_info(r) for r in s.scalars(query.order_by(Release.id))]


def repair(ledger: Ledger, bridge: MlflowBridge, model_id: Optional[int] = None) -> list[str]:
    """Make MLflow's aliases match the ledger's; returns what was changed (empty: in sync)."""
    changes: list[str] = []
    with ledger.transaction() as s:
        query = select(RegisteredModel).order_by(RegisteredModel.id)
        if model_id is not None:
            query = query.where(RegisteredModel.id == model_id)
        models = [(m.id, m.name) for m in s.scalars(query)]
    for mid, name in models:
        with ledger.transaction() as s:
            wanted = {
                h.alias: s.get(ModelVersion, h.model_version_id)
                for h in s.scalars(select(AliasHolder).where(AliasHolder.registered_model_id == mid))
            }
            wanted = {alias: (row.mlflow_version, f"{row.name} (id {row.id})") for alias, row in wanted.items()}
        have = bridge.aliases(name)
        for alias in MANAGED_ALIASES:
            if alias not in wanted:
                if alias in have:
                    bridge.delete_alias(name, alias)
                    changes.append(f"{name}@{alias}: removed (the ledger has no holder)")
                continue
            mlflow_version, label = wanted[alias]
            if mlflow_version is None:
                raise PromotionError(f"{name}@{alias}: {label} is not in MLflow; publish it, then repair")
            if have.get(alias) != mlflow_version:
                bridge.set_alias(name, alias, mlflow_version)
                changes.append(f"{name}@{alias}: {have.get(alias)} -> {mlflow_version} ({label})")
        with ledger.transaction() as s:
            s.execute(
                update(Release)
                .where(Release.registered_model_id == mid, Release.mlflow_synced_at.is_(None))
                .values(mlflow_synced_at=utcnow())
            )
    return changes
