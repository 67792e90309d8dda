"""The release-level commands of `atlas`: update, serve, status, compare, history, rollback, renominate, gate,
submit (and, from flows/cli_use.py, generate and export)."""
from __future__ import annotations

import argparse
import json


def _model(platform, args: argparse.Namespace):
    from registry import LedgerError, get_model, model_name_for

    name = args.model or model_name_for(args.backbone, args.line)
    try:
        return get_model(platform.ledger, name)
    except LedgerError as e:
        raise LedgerError(f"{e} (run `atlas update` first, or pass --model / --backbone / --line)") from None


def _platform():
    from .platform import open_platform

    return open_platform()


def _check_cycle_files(config: str, policy: str, backbone: str | None = None, skill: str | None = None,
                       line: str | None = None, snapshot: str | None = None):
    """A cycle's config, policy and snapshot (the `update` flow's parameters), validated before
    Prefect starts: a typo is reported at once, and nothing is opened or written."""
    from .config import load_update_config
    from .policy import load_cycle_policy
    from .skills import resolve_snapshot

    cfg = load_update_config(config, backbone=backbone, skill=skill, line=line)
    load_cycle_policy(policy, cfg)
    if snapshot is not None:
        resolve_snapshot(snapshot)
    return cfg


def cmd_update(args: argparse.Namespace) -> int:
    _check_cycle_files(args.config, args.policy, args.backbone, args.skill, args.line, args.snapshot)
    from .update import update

    result = update(config=args.config, policy=args.policy, backbone=args.backbone, skill=args.skill,
                    snapshot=args.snapshot, line=args.line)
    if result["outcome"] == "idle":
        print(f"\n{result['model']}: idle: {result['reason']} (champion: {result['champion']})")
        return 0
    verdicts = ", ".join(f"{name}: {'pass' if ok else 'reject'}" for name, ok in result["candidates"].items())
    print(f"\n{result['model']}: {'PROMOTED ' + result['champion'] if result['promoted'] else 'not promoted'}"
          f" (champion before: {result['previous_champion']}, now: {result['champion']})")
    print(f"candidates: {verdicts or 'none new'}")
    print(f"report:     {result['report']}")
    print("time:       " + ", ".join(f"{phase} {sec:.0f} s" for phase, sec in result["seconds"].items()))
    print(f"MLflow UI:  .venv/bin/mlflow ui --backend-store-uri sqlite:///{result['state']}/mlflow/mlflow.db"
          if "ATLAS_MLFLOW_TRACKING_URI" not in __import__("os").environ else "MLflow UI:  your tracking server")
    print(f"details:    atlas status / atlas history / atlas gate --explain VERSION  (--model {result['model']})")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve import serve_update, serving_plan

    plan = serving_plan(args.deployment, args.cron, config=args.config, policy=args.policy, backbone=args.backbone,
                        skill=args.skill, line=args.line, snapshot=args.snapshot)
    for d in plan:  # every served cycle's files, validated before anything is served
        _check_cycle_files(**d["parameters"])
    serve_update(plan)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from registry import alias_holder, base_version, latest_evaluation, recent_decisions, recent_training_runs

    from .report import latest_report

    p = _platform()
    try:
        for key, value in p.describe().items():
            print(f"{key:10s} {value}")
        model = _model(p, args)
        champion = alias_holder(p.ledger, model.id) or base_version(p.ledger, model.id)
        ev = latest_evaluation(p.ledger, champion.id)
        target = f", target {ev.target_solved}/{ev.target_total}" if ev else ""
        print(f"\nmodel      {model.name}\nchampion   {champion.name} (#{champion.id}, MLflow version "
              f"{champion.mlflow_version or '-'}{target})")
        print(f"report     {latest_report(p.state, model.name) or '-'}")
        print("\nlast gate decisions:")
        for did, name, passed, policy, when in recent_decisions(p.ledger, model.id, args.limit):
            print(f"  {when}  #{did:<4d} {'PASS  ' if passed else 'REJECT'} {name}  ({policy})")
        print("last training runs:")
        for r in recent_training_runs(p.ledger, _backbone_id(p, model), None, args.limit, model_id=model.id):
            print(f"  {r['started']}  #{r['id']:<4d} {r['skill']} {r['method']} seed {r['seed']}: {r['status']}")
    finally:
        p.close()
    if not args.no_prefect:
        from .serve import prefect_status

        print("\n" + prefect_status(args.limit))
    return 0


def _backbone_id(p, model) -> int:
    from registry import ensure_backbone

    return ensure_backbone(p.ledger, model.backbone, model.revision)


def cmd_compare(args: argparse.Namespace) -> int:
    from registry import compare_versions, resolve_version

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
    from registry import alias_holder, format_history, release_history

    from .history import line_history

    p = _platform()
    try:
        model = _model(p, args)
        rows = release_history(p.ledger, model.id)
        print(format_history(rows, markdown=args.markdown) if rows else "no releases yet")
        champion = alias_holder(p.ledger, model.id)
        if champion is not None:
            print(f"\nthe line up to {champion.name}: score matrix R[t][i], OP_t, BWT_t (TRACE, on one 0-1 scale), "
                  "KL vs base and vs teacher\n")
            print(line_history(p.ledger, model.id, champion.id).to_markdown())
    finally:
        p.close()
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from .release import rollback

    p = _platform()
    try:
        model = _model(p, args)
    finally:
        p.close()
    release = rollback(model.name, args.reason)
    print(f"{model.name}: champion rolled back (release #{release.id}, version id {release.version_id}, "
          f"previous {release.previous_version_id}); reason recorded: {args.reason}")
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
    print(f"{model.name}: {version.name} re-nominated (release #{release.id}); a later cycle gates it again "
          f"against the champion; reason recorded: {args.reason}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from .submit import submit_candidate

    s = submit_candidate(args.source, args.line, parent=args.parent, skill=args.skill, name=args.name,
                         backbone=args.backbone)
    if args.json:
        print(json.dumps(s.__dict__, indent=2))
        return 0
    said = "submitted" if s.new else "already submitted (nothing recorded again)"
    print(f"{s.model}: {said}: {s.version} (#{s.version_id}), a {s.kind} delta on top of {s.parent}, "
          f"sha256 {s.sha256[:16]}")
    print(f"next: atlas gate check {s.version} --config CONFIG --policy POLICY [--promote]")
    return 0


def _check_gate_inputs(args: argparse.Namespace) -> None:
    """The gate check's files, line and version, validated before Prefect starts (exit 2, one line)."""
    from registry import get_model, model_name_for

    from .gate_check import candidate_version

    cfg = _check_cycle_files(args.config, args.policy, line=args.line)
    p = _platform()
    try:
        model = get_model(p.ledger, model_name_for(cfg.backbone, cfg.line_name))
        candidate_version(p.ledger, model.id, args.version, cfg.skill)
    finally:
        p.close()


def cmd_gate_check(args: argparse.Namespace) -> int:
    """Exit 0: the version passed (and was promoted with --promote); 1: rejected; 2: bad input."""
    _check_gate_inputs(args)
    from .gate_check import gate_candidate

    r = gate_candidate(args.version, config=args.config, policy=args.policy, line=args.line, promote=args.promote)
    if args.json:
        print(json.dumps(r.to_dict(), indent=2, default=str))
    else:
        verdict = "PASS" if r.passed else "REJECT"
        moved = f"; promoted: champion is now {r.champion}" if r.promoted else ""
        print(f"\n{r.model}: {r.version}: {verdict} by policy {r.policy} against {r.against}{moved}")
        _print_checks(r.checks)
        print(f"report: {r.report}")
    return 0 if r.passed else 1


def _print_checks(checks) -> None:
    width = max(len(c.name) for c in checks)
    for c in checks:
        fmt = lambda v: "missing" if v is None else f"{v:.4g}"  # noqa: E731
        print(f"  {'ok  ' if c.passed else 'FAIL'} {c.name:{width}s}  measured {fmt(c.measured):>10s}  "
              f"limit {fmt(c.threshold):>8s}  {c.detail}")


def cmd_gate(args: argparse.Namespace) -> int:
    from registry import get_version, latest_gate_decision, resolve_version

    if getattr(args, "gate_command", None) == "check":
        return cmd_gate_check(args)
    if args.explain is None:
        raise ValueError("give --explain VERSION, or `atlas gate check VERSION --config C --policy P`")
    p = _platform()
    try:
        version = resolve_version(p.ledger, _model(p, args).id, args.explain)
        decision = latest_gate_decision(p.ledger, version.id)
        if decision is None:
            print(f"{version.name}: no gate decision recorded")
            return 1
        against = get_version(p.ledger, decision.release_version_id).name if decision.release_version_id else "base"
        if args.json:
            print(json.dumps({"version": version.name, "passed": decision.passed, "policy": decision.policy_name,
                              "against": against, "checks": [c.__dict__ for c in decision.checks]}, indent=2))
            return 0
        print(f"{version.name}: {'PASS' if decision.passed else 'REJECT'} by policy {decision.policy_name} "
              f"(decision #{decision.id}, {decision.created_at:%Y-%m-%d %H:%M:%S}, measured against {against})")
        _print_checks(decision.checks)
    finally:
        p.close()
    return 0


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    from .platform import DEFAULT_CONFIG, DEFAULT_POLICY

    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--line", "--skill", dest="line", default="assistant",
                       help="release line of the registered model (default: %(default)s)")
    model.add_argument("--model", default=None, help="registered model name (default: <backbone>.<line>)")
    cycle = argparse.ArgumentParser(add_help=False)
    cycle.add_argument("--config", default=DEFAULT_CONFIG, help="update config YAML (default: %(default)s)")
    cycle.add_argument("--policy", default=DEFAULT_POLICY, help="release policy YAML (default: %(default)s)")
    cycle.add_argument("--backbone", default=None, help="override the config's backbone")
    cycle.add_argument("--skill", default=None, help="override the config's skill")
    cycle.add_argument("--line", default=None, help="override the config's release line")
    cycle.add_argument("--snapshot", default=None,
                       help="the skill's training data: a JSONL file, or a folder whose newest snapshot is taken")

    p = sub.add_parser("update", parents=[cycle], help="run one update cycle now: atlas, training, evaluation, gate, "
                       "promotion, report")
    p.set_defaults(func=cmd_update)
    p = sub.add_parser("serve", parents=[cycle], help="serve the scheduled `update` deployments (one per line or skill) "
                       "of deploy/prefect.yaml from this process")
    p.add_argument("--deployment", action="append", default=None, metavar="NAME",
                   help="a deployment of deploy/prefect.yaml to serve (repeatable; default: every scheduled one)")
    p.add_argument("--cron", default=None, help="cron schedule of the one served deployment (default: its own)")
    p.set_defaults(func=cmd_serve, config=None, policy=None)  # unset: each deployment's own parameters
    p = sub.add_parser("status", parents=[common, model], help="champion, last gate decisions and runs, next scheduled run")
    p.add_argument("--limit", type=int, default=5, help="rows per list")
    p.add_argument("--no-prefect", action="store_true", help="skip the Prefect query (the server's API, or the local database in local mode)")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("compare", parents=[common, model], help="compare version B against version A from stored records")
    p.add_argument("a", help="reference version: base, champion, candidate, a version name, mlflow:<n> or #<id>")
    p.add_argument("b", help="compared version (same forms)")
    p.add_argument("--format", default="text", choices=["text", "markdown", "json"])
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("history", parents=[common, model], help="every release of the model with its key metrics")
    p.add_argument("--markdown", action="store_true")
    p.set_defaults(func=cmd_history)
    p = sub.add_parser("rollback", parents=[common, model], help="move champion back to the previous holder")
    p.add_argument("--reason", required=True, help="why (recorded in the ledger and shown in history)")
    p.set_defaults(func=cmd_rollback)
    p = sub.add_parser("renominate", parents=[common, model], help="make a rolled-back (retired) version a candidate again")
    p.add_argument("version", help="version: name, mlflow:<n> or #<id>")
    p.add_argument("--reason", required=True, help="why (recorded in the ledger)")
    p.set_defaults(func=cmd_renominate)
    p = sub.add_parser("gate", parents=[common, model], help="explain a version's gate decision check by check "
                       "(--explain), or gate a candidate now (gate check)")
    p.add_argument("--explain", default=None, metavar="VERSION", help="version: name, champion, mlflow:<n> or #<id>")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_gate)
    gate_sub = p.add_subparsers(dest="gate_command", metavar="check")
    check = gate_sub.add_parser("check", help="evaluate a candidate (e.g. a submitted one) against the champion with "
                                "a policy and record the decision; exit 0 pass, 1 reject, 2 bad input")
    check.add_argument("version", help="the candidate: a version name, mlflow:<n> or #<id>")
    check.add_argument("--config", default=DEFAULT_CONFIG, help="update config: the skill, line, retained set "
                       "(default: %(default)s)")
    check.add_argument("--policy", default=DEFAULT_POLICY, help="release policy YAML (default: %(default)s)")
    check.add_argument("--line", default=None, help="override the config's release line")
    check.add_argument("--promote", action="store_true", help="make it the champion if it passes")
    check.add_argument("--json", action="store_true")

    p = sub.add_parser("submit", parents=[common], help="record an adapter trained elsewhere (PEFT LoRA folder, delta "
                       "file, release folder or MLflow model URI) as a candidate version of a line")
    p.add_argument("source", help="a PEFT adapter folder (save_pretrained), a delta .safetensors with its .json, a "
                   "release folder, or models:/... / runs:/...")
    p.add_argument("--line", required=True, help="the line (or registered model name) it joins")
    p.add_argument("--parent", default="champion", help="the version it was trained on top of: champion (default), "
                   "base, a version name, mlflow:<n> or #<id>")
    p.add_argument("--skill", default=None, help="the skill it teaches (default: the line's name)")
    p.add_argument("--name", default=None, help="the version's name (default: <backbone>-<skill>-<kind>-s0-e0)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_submit)

    from .cli_use import add_commands as add_use_commands

    add_use_commands(sub, common, model)
