"""The cycle commands of `atlas`: update, serve, submit, squash, gate check (and, from flows/cli_ops.py, the
operational commands status, compare, history, gate --explain, rollback, renominate; from
flows/cli_use.py, generate and export)."""

from __future__ import annotations

import argparse
import json

from .cli_ops import print_checks


def cmd_update(args: argparse.Namespace) -> int:
    # Parsed and checked once, before Prefect starts: a typo is reported at once, nothing is written.
    from .cycle import load_cycle

    cfg, pol = load_cycle(args.config, args.policy, args.backbone, args.skill, args.line, args.snapshot)
    from .platform import PlatformRef
    from .update import update_parsed

    print_result(update_parsed(cfg, pol, PlatformRef.from_environment()))
    return 0


def print_result(result) -> None:
    """A flows.cycle.CycleResult as the lines `atlas update` ends with."""
    import os

    if result.outcome == "idle":
        print(f"\n{result.model}: idle: {result.reason} (champion: {result.champion})")
        return
    verdicts = ", ".join(f"{name}: {'pass' if ok else 'reject'}" for name, ok in result.candidates.items())
    print(
        f"\n{result.model}: {'PROMOTED ' + result.champion if result.promoted else 'not promoted'}"
        f" (champion before: {result.previous_champion}, now: {result.champion})"
    )
    print(f"candidates: {verdicts or 'none new'}")
    for name, why in result.failed.items():
        print(f"failed:     {name}: {why}")
    print(f"report:     {result.report}")
    print("time:       " + ", ".join(f"{phase} {sec:.0f} s" for phase, sec in result.seconds.items()))
    print(
        f"MLflow UI:  .venv/bin/mlflow ui --backend-store-uri sqlite:///{result.state}/mlflow/mlflow.db"
        if "ATLAS_MLFLOW_TRACKING_URI" not in os.environ
        else "MLflow UI:  your tracking server"
    )
    print(f"details:    atlas status / atlas history / atlas gate --explain VERSION  (--model {result.model})")


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve import serve_update, serving_plan

    plan = serving_plan(
        args.deployment,
        args.cron,
        config=args.config,
        policy=args.policy,
        backbone=args.backbone,
        skill=args.skill,
        line=args.line,
        snapshot=args.snapshot,
    )
    from .cycle import load_cycle

    for d in plan:  # every served cycle's files, validated before anything is served
        load_cycle(**d["parameters"])
    serve_update(plan)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from .submit import submit_candidate

    s = submit_candidate(
        args.source, args.line, parent=args.parent, skill=args.skill, name=args.name, backbone=args.backbone
    )
    if args.json:
        print(json.dumps(s.__dict__, indent=2))
        return 0
    said = "submitted" if s.new else "already submitted (nothing recorded again)"
    print(
        f"{s.model}: {said}: {s.version} (#{s.version_id}), a {s.kind} delta on top of {s.parent}, "
        f"sha256 {s.sha256[:16]}"
    )
    print(f"next: atlas gate check {s.version} --config CONFIG --policy POLICY [--promote]")
    if s.new:
        from .events import CANDIDATE_SUBMITTED, emit

        labels = {"prefect.resource.name": s.version, "atlas.line": args.line}
        payload = {"version": s.version, "version_id": s.version_id, "parent": s.parent, "kind": s.kind}
        if emit(CANDIDATE_SUBMITTED, f"atlas.candidate.{s.model}", labels, payload):
            print(f"event:  {CANDIDATE_SUBMITTED} sent (a deployment trigger on it gates the candidate)")
    return 0


def cmd_squash(args: argparse.Namespace) -> int:
    from .squash import squash_version

    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    s = squash_version(args.line, args.version, args.rank, args.name, domains, args.contexts)
    if args.json:
        print(json.dumps(s.__dict__, indent=2))
        return 0
    said = "squashed" if s.new else "already squashed (nothing recorded again)"
    how = "exact" if s.rank is None else f"rank {s.rank} per module"
    ranks = sorted({(m["rank_in"], m["rank_out"]) for m in s.modules.values()})
    print(
        f"{s.model}: {said}: {s.source}'s chain of {s.deltas} deltas -> {s.version} (#{s.version_id}), one "
        f"LoRA on {len(s.modules)} modules on the base ({how}; rank {', '.join(f'{a}->{b}' for a, b in ranks)})"
    )
    print("KL(chain || squash): " + ", ".join(f"{d} {v:.3g}" for d, v in s.kl_vs_source.items()) + " nats/token")
    print(f"next: atlas gate check {s.version} --config CONFIG --policy configs/policy/squash.yaml [--promote]")
    return 0


def cmd_snapshot_add(args: argparse.Namespace) -> int:
    from atlas_core.paths import state_dir

    from .snapshots import add_snapshot, announce

    snap = add_snapshot(args.file, args.line, args.skill, state_dir())
    print(f"{snap.line}/{snap.skill}: snapshot {snap.path} ({snap.pairs} pairs, sha256 {snap.sha256[:16]})")
    if announce(snap):
        print(f"event: atlas.snapshot.added sent for {snap.resource_id} (deployment triggers on it start a cycle)")
    else:
        print("event: none (PREFECT_API_URL is not set); the next scheduled cycle takes it")
    return 0


def _check_gate_inputs(args: argparse.Namespace) -> None:
    """The gate check's files, line and version, validated before Prefect starts (exit 2, one line)."""
    from registry import get_model, model_name_for

    from .cycle import load_cycle
    from .gate_check import candidate_version
    from .platform import open_platform

    cfg, _ = load_cycle(args.config, args.policy, line=args.line)
    p = open_platform()
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
        print_checks(r.checks)
        print(f"report: {r.report}")
    return 0 if r.passed else 1


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    from .platform import DEFAULT_CONFIG, DEFAULT_POLICY

    model = argparse.ArgumentParser(add_help=False)
    model.add_argument(
        "--line",
        "--skill",
        dest="line",
        default="assistant",
        help="release line of the registered model (default: %(default)s)",
    )
    model.add_argument("--model", default=None, help="registered model name (default: <backbone>.<line>)")

    def cycle(config: str | None, policy: str | None) -> argparse.ArgumentParser:
        """A cycle's arguments; a parser of its own per command, since argparse shares a parent's
        actions (set_defaults on one command would change the other's defaults)."""
        c = argparse.ArgumentParser(add_help=False)
        c.add_argument("--config", default=config, help="update config YAML (default: %(default)s)")
        c.add_argument("--policy", default=policy, help="release policy YAML (default: %(default)s)")
        c.add_argument("--backbone", default=None, help="override the config's backbone")
        c.add_argument("--skill", default=None, help="override the config's skill")
        c.add_argument("--line", default=None, help="override the config's release line")
        c.add_argument(
            "--snapshot",
            default=None,
            help="the skill's training data: a JSONL file, or a folder whose newest complete snapshot "
            "(last *.jsonl by name) is taken",
        )
        return c

    p = sub.add_parser(
        "update",
        parents=[cycle(DEFAULT_CONFIG, DEFAULT_POLICY)],
        help="run one update cycle now: atlas, training, evaluation, gate, promotion, report",
    )
    p.set_defaults(func=cmd_update)
    # None: each served deployment keeps its own config and policy (deploy/prefect.yaml).
    p = sub.add_parser(
        "serve",
        parents=[cycle(None, None)],
        help="serve the scheduled `update` deployments (one per "
        "line or skill) of deploy/prefect.yaml from this process",
    )
    p.add_argument(
        "--deployment",
        action="append",
        default=None,
        metavar="NAME",
        help="a deployment of deploy/prefect.yaml to serve (repeatable; default: every scheduled one)",
    )
    p.add_argument("--cron", default=None, help="cron schedule of the one served deployment (default: its own)")
    p.set_defaults(func=cmd_serve)

    from .cli_ops import add_commands as add_ops_commands

    p = add_ops_commands(sub, common, model)  # status, compare, history, rollback, renominate, gate
    gate_sub = p.add_subparsers(dest="gate_command", metavar="check")
    check = gate_sub.add_parser(
        "check",
        help="evaluate a candidate (e.g. a submitted one) against the champion with "
        "a policy and record the decision; exit 0 pass, 1 reject, 2 bad input",
    )
    check.add_argument("version", help="the candidate: a version name, mlflow:<n> or #<id>")
    check.add_argument(
        "--config", default=DEFAULT_CONFIG, help="update config: the skill, line, retained set (default: %(default)s)"
    )
    check.add_argument("--policy", default=DEFAULT_POLICY, help="release policy YAML (default: %(default)s)")
    check.add_argument("--line", default=None, help="override the config's release line")
    check.add_argument("--promote", action="store_true", help="make it the champion if it passes")
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=cmd_gate_check)  # a subcommand's default replaces `gate`'s own

    p = sub.add_parser(
        "submit",
        parents=[common],
        help="record an adapter trained elsewhere (PEFT LoRA folder, delta "
        "file, release folder or MLflow model URI) as a candidate version of a line",
    )
    p.add_argument(
        "source",
        help="a PEFT adapter folder (save_pretrained), a delta .safetensors with its .json, a "
        "release folder, or models:/... / runs:/...",
    )
    p.add_argument("--line", required=True, help="the line (or registered model name) it joins")
    p.add_argument(
        "--parent",
        default="champion",
        help="the version it was trained on top of: champion (default), base, a version name, mlflow:<n> or #<id>",
    )
    p.add_argument("--skill", default=None, help="the skill it teaches (default: the line's name)")
    p.add_argument("--name", default=None, help="the version's name (default: <backbone>-<skill>-<kind>-s0-e0)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser(
        "squash",
        parents=[common],
        help="a chain of LoRA-family deltas as one delta (exact, or truncated with --rank): a candidate "
        "version on the base, gated like any other",
    )
    p.add_argument("--line", required=True, help="the line (or registered model name)")
    p.add_argument("--version", default="champion", help="whose chain: champion (default), a version name or #<id>")
    p.add_argument("--rank", type=int, default=None, help="keep this rank per module (default: exact, ranks summed)")
    p.add_argument("--name", default=None, help="the new version's name (default: <backbone>-<skill>-peft-lora-s0-e0)")
    p.add_argument(
        "--domains",
        default="gsm8k,csqa",
        help="retained domains the KL vs the chain is measured on (default: %(default)s)",
    )
    p.add_argument("--contexts", type=int, default=32, help="contexts per domain for that KL (default: %(default)s)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_squash)

    p = sub.add_parser("snapshot", help="a skill's training data: add a snapshot (announced as a Prefect event)")
    snapshot_sub = p.add_subparsers(dest="snapshot_command", metavar="add", required=True)
    add = snapshot_sub.add_parser(
        "add",
        help="copy a JSONL file of prompt/response pairs, complete, into <state>/snapshots/LINE/SKILL/ and emit "
        "atlas.snapshot.added (deployment triggers start the line's cycle on it)",
    )
    add.add_argument("file", help='a JSONL file, one {"id", "prompt", "response"} per line')
    add.add_argument("--line", required=True, help="the release line")
    add.add_argument("--skill", required=True, help="the skill the snapshot teaches")
    add.set_defaults(func=cmd_snapshot_add)

    from .cli_use import add_commands as add_use_commands

    add_use_commands(sub, common, model)
