"""The operational commands of `atlas`: status, compare, history, gate --explain, rollback, renominate.

They read the ledger (and `rollback` moves MLflow's alias), so they must answer at once, even while
a cycle runs: nothing here imports Prefect, and nothing imports torch except what `history` needs to
rebuild a skill's scorer. `rollback` in particular is not a Prefect flow run from the CLI: in local
mode a flow run starts Prefect's temporary server first (16-20 s measured for a ledger write of
milliseconds). `rollback_champion` is the one function the command and the `rollback` flow
(flows/release.py, for deployments) share.

`status` reads Prefect's flow runs from a Prefect server (PREFECT_API_URL) by default; in embedded
mode (no server) only with `--prefect`, which reads the local database in-process (Prefect's
server models: seconds of imports, but no server is started).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


def _platform():
    from .platform import open_platform

    return open_platform()


def _model(platform, args: argparse.Namespace):
    """The registered model the command names (--model, or --backbone + --line)."""
    from registry import LedgerError, get_model, model_name_for

    name = args.model or model_name_for(args.backbone, args.line)
    try:
        return get_model(platform.ledger, name)
    except LedgerError as e:
        raise LedgerError(f"{e} (run `atlas update` first, or pass --model / --backbone / --line)") from None


@dataclass(frozen=True)
class RolledBack:
    model: str  # the registered model's name
    champion: str  # the version that serves now (the base's name when nobody holds `champion`)
    release: object  # registry.ReleaseInfo of the rollback


def rollback_champion(platform, model: str | int, reason: str, flow_run_id: Optional[str] = None) -> RolledBack:
    """Move `champion` of a registered model (name or ledger id) back to its previous holder, or to
    the base, and retire the version rolled back (registry.rollback: ledger first, then MLflow).
    A line nobody holds `champion` of raises registry.RollbackError (a PromotionError)."""
    from registry import get_model, get_version, rollback

    info = get_model(platform.ledger, int(model) if str(model).isdigit() else model)
    release = rollback(platform.ledger, platform.bridge, info.id, reason, flow_run_id=flow_run_id)
    return RolledBack(model=info.name, champion=get_version(platform.ledger, release.version_id).name, release=release)


def latest_report(state: Path, model_name: str) -> Path | None:
    """The newest cycle report of a line: the folder flows/report.py names in `reports/<model>/LATEST`."""
    pointer = state / "reports" / model_name / "LATEST"
    if not pointer.is_file():
        return None
    path = Path(pointer.read_text().strip()) / "report.md"
    return path if path.is_file() else None


def prefect_server() -> bool:
    """Whether flows run against a Prefect server (PREFECT_API_URL in the environment, or in the
    settings of a Prefect already imported by this process) rather than in local mode."""
    if os.environ.get("PREFECT_API_URL"):
        return True
    settings = sys.modules.get("prefect.settings")
    return bool(settings is not None and settings.PREFECT_API_URL.value())


def cmd_status(args: argparse.Namespace) -> int:
    from registry import (
        alias_holder,
        base_version,
        ensure_backbone,
        latest_evaluation,
        recent_decisions,
        recent_training_runs,
    )

    p = _platform()
    try:
        for key, value in p.describe().items():
            print(f"{key:10s} {value}")
        model = _model(p, args)
        champion = alias_holder(p.ledger, model.id) or base_version(p.ledger, model.id)
        ev = latest_evaluation(p.ledger, champion.id)
        target = f", target {ev.target_solved}/{ev.target_total}" if ev else ""
        print(
            f"\nmodel      {model.name}\nchampion   {champion.name} (#{champion.id}, MLflow version "
            f"{champion.mlflow_version or '-'}{target})"
        )
        print(f"report     {latest_report(p.state, model.name) or '-'}")
        print("\nlast gate decisions:")
        for did, name, passed, policy, when in recent_decisions(p.ledger, model.id, args.limit):
            print(f"  {when}  #{did:<4d} {'PASS  ' if passed else 'REJECT'} {name}  ({policy})")
        print("last training runs:")
        backbone_id = ensure_backbone(p.ledger, model.backbone, model.revision)
        for r in recent_training_runs(p.ledger, backbone_id, None, args.limit, model_id=model.id):
            print(f"  {r['started']}  #{r['id']:<4d} {r['skill']} {r['method']} seed {r['seed']}: {r['status']}")
    finally:
        p.close()
    if args.prefect or (prefect_server() and not args.no_prefect):
        from .prefect_runs import prefect_status

        print("\n" + prefect_status(args.limit))
    elif not args.no_prefect:
        print(
            "\nPrefect (flow 'update'): local mode, not read (that takes seconds); `atlas status --prefect` "
            "reads its flow runs"
        )
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from registry import resolve_version

    from .compare import compare_versions

    p = _platform()
    try:
        model = _model(p, args)
        a, b = resolve_version(p.ledger, model.id, args.a), resolve_version(p.ledger, model.id, args.b)
        cmp = compare_versions(p.ledger, a.id, b.id)
        print({"text": cmp.to_table, "markdown": cmp.to_markdown, "json": cmp.to_json}[args.format]())
    finally:
        p.close()
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    from registry import alias_holder, release_history

    from .compare import format_history
    from .history import line_history

    p = _platform()
    try:
        model = _model(p, args)
        rows = release_history(p.ledger, model.id)
        print(format_history(rows, markdown=args.markdown) if rows else "no releases yet")
        champion = alias_holder(p.ledger, model.id)
        if champion is not None:
            print(
                f"\nthe line up to {champion.name}: score matrix R[t][i], OP_t, BWT_t (TRACE, on one 0-1 scale), "
                "KL vs base and vs teacher\n"
            )
            print(line_history(p.ledger, model.id, champion.id).to_markdown())
    finally:
        p.close()
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    p = _platform()
    try:
        done = rollback_champion(p, _model(p, args).id, args.reason)
    finally:
        p.close()
    r = done.release
    print(
        f"{done.model}: champion rolled back to {done.champion} (release #{r.id}, version id {r.version_id}, "
        f"previous {r.previous_version_id}); reason recorded: {args.reason}"
    )
    return 0


def cmd_renominate(args: argparse.Namespace) -> int:
    """A retired (rolled-back) version may be promoted again by later cycles; the alias does not move."""
    from registry import renominate, resolve_version

    p = _platform()
    try:
        model = _model(p, args)
        version = resolve_version(p.ledger, model.id, args.version)
        release = renominate(p.ledger, version.id, args.reason)
    finally:
        p.close()
    print(
        f"{model.name}: {version.name} re-nominated (release #{release.id}); a later cycle gates it again "
        f"against the champion; reason recorded: {args.reason}"
    )
    return 0


def print_checks(checks) -> None:
    width = max(len(c.name) for c in checks)
    for c in checks:
        fmt = lambda v: "missing" if v is None else f"{v:.4g}"
        print(
            f"  {'ok  ' if c.passed else 'FAIL'} {c.name:{width}s}  measured {fmt(c.measured):>10s}  "
            f"limit {fmt(c.threshold):>8s}  {c.detail}"
        )


def cmd_gate(args: argparse.Namespace) -> int:
    from atlas_core.errors import InputError
    from registry import get_version, latest_gate_decision, resolve_version

    if args.explain is None:
        raise InputError("give --explain VERSION, or `atlas gate check VERSION --config C --policy P`")
    p = _platform()
    try:
        version = resolve_version(p.ledger, _model(p, args).id, args.explain)
        decision = latest_gate_decision(p.ledger, version.id)
        if decision is None:
            print(f"{version.name}: no gate decision recorded")
            return 1
        against = get_version(p.ledger, decision.release_version_id).name if decision.release_version_id else "base"
        if args.json:
            print(
                json.dumps(
                    {
                        "version": version.name,
                        "passed": decision.passed,
                        "policy": decision.policy_name,
                        "against": against,
                        "checks": [c.__dict__ for c in decision.checks],
                    },
                    indent=2,
                )
            )
            return 0
        print(
            f"{version.name}: {'PASS' if decision.passed else 'REJECT'} by policy {decision.policy_name} "
            f"(decision #{decision.id}, {decision.created_at:%Y-%m-%d %H:%M:%S}, measured against {against})"
        )
        print_checks(decision.checks)
    finally:
        p.close()
    return 0


def add_commands(sub, common: argparse.ArgumentParser, model: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The operational commands' parsers; returns `gate`'s (flows/cli_release.py adds `gate check`)."""
    p = sub.add_parser(
        "status",
        parents=[common, model],
        help="champion, last gate decisions and runs, next scheduled run",
        description="The line's champion, its last gate decisions and training runs, from the ledger. "
        "Prefect's `update` flow runs (the next scheduled one, the last ones) are read from a Prefect "
        "server (PREFECT_API_URL) by default; in local mode (no server) only with --prefect, which reads "
        "Prefect's database under the state folder in this process: no server is started, but its "
        "imports take seconds, and `atlas status` otherwise answers in about one.",
    )
    p.add_argument("--limit", type=int, default=5, help="rows per list")
    p.add_argument(
        "--prefect",
        action="store_true",
        help="also read Prefect's flow runs in local mode (no "
        "PREFECT_API_URL): from its database under the state folder, in this process (no server is "
        "started; the imports take seconds). With a Prefect server they are read by default",
    )
    p.add_argument("--no-prefect", action="store_true", help="skip the Prefect query, even with a Prefect server")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser(
        "compare", parents=[common, model], help="compare version B against version A from stored records"
    )
    p.add_argument("a", help="reference version: base, champion, candidate, a version name, mlflow:<n> or #<id>")
    p.add_argument("b", help="compared version (same forms)")
    p.add_argument("--format", default="text", choices=["text", "markdown", "json"])
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("history", parents=[common, model], help="every release of the model with its key metrics")
    p.add_argument("--markdown", action="store_true")
    p.set_defaults(func=cmd_history)
    p = sub.add_parser(
        "rollback",
        parents=[common, model],
        help="move champion back to the previous holder (or the "
        "base) and retire the version rolled back; exit 2 when nobody holds champion",
    )
    p.add_argument("--reason", required=True, help="why (recorded in the ledger and shown in history)")
    p.set_defaults(func=cmd_rollback)
    p = sub.add_parser(
        "renominate", parents=[common, model], help="make a rolled-back (retired) version a candidate again"
    )
    p.add_argument("version", help="version: name, mlflow:<n> or #<id>")
    p.add_argument("--reason", required=True, help="why (recorded in the ledger)")
    p.set_defaults(func=cmd_renominate)
    p = sub.add_parser(
        "gate",
        parents=[common, model],
        help="explain a version's gate decision check by check (--explain), or gate a candidate now (gate check)",
    )
    p.add_argument("--explain", default=None, metavar="VERSION", help="version: name, champion, mlflow:<n> or #<id>")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_gate)
    return p
