"""The commands that use a release: `atlas generate` and `atlas export`.

    atlas generate --line code "Write a function that reverses a string."      # streams the reply
    atlas generate --line code --input prompts.jsonl --output replies.jsonl
    atlas export champion --line code --format peft --out exports/code-peft

A version is named as everywhere else (champion, base, a version name, mlflow:<n>, #<id>)
within --model / --backbone + --line, or given as an MLflow model URI or a release folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from atlas_core.errors import InputError


def _load(args: argparse.Namespace):
    from .serving import load_release

    target, version = _target(args)
    return load_release(
        target, version, dtype=args.dtype, device=args.device, backbone=args.backbone, **_opt_outs(args)
    )


def _opt_outs(args: argparse.Namespace) -> dict[str, bool]:
    """What a person explicitly chose not to verify (atlas_core.release.load_folder)."""
    return {"verify_backbone": not args.no_verify_backbone, "require_sidecar": not args.allow_legacy_folder}


def _target(args: argparse.Namespace) -> tuple[str, str]:
    """(registered model, URI or folder; version) from the arguments."""
    from registry import model_name_for

    version = args.version
    if version.startswith(("models:/", "runs:/")) or Path(version).expanduser().is_dir():
        return version, "champion"
    return args.model or model_name_for(args.backbone, args.line), version


def check_device(name: str | None) -> str | None:
    """--device, checked before anything loads: a device torch can name whose hardware this machine
    has (cpu, cuda, cuda:N, mps, xpu:N...). A typo or a missing GPU is one line, not a traceback
    seconds later from inside the model's `.to()`. None (the default) is the CPU."""
    if name is None:
        return None
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise InputError(f"--device {name!r}: not a torch device; expected cpu, cuda, cuda:N, mps, ...") from None
    if device.type == "cpu":
        return name
    if device.type == "mps":
        count = int(torch.backends.mps.is_available())
    else:
        backend = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, ...
        available = backend is not None and hasattr(backend, "is_available") and backend.is_available()
        count = backend.device_count() if available and hasattr(backend, "device_count") else int(available)
    if count == 0:
        raise InputError(
            f"--device {name}: this machine has no {device.type} device that torch {torch.__version__} can use"
        )
    if device.index is not None and device.index >= count:
        raise InputError(
            f"--device {name}: this machine has {count} {device.type} device(s), "
            f"{device.type}:0 to {device.type}:{count - 1}"
        )
    return name


def _read_prompts(path: str) -> list[str]:
    """One prompt per line: {"prompt": "..."} or a JSON string."""
    prompts = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise InputError(f"--input {path}: cannot be read ({e.strerror})") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise InputError(f"--input {path}, line {n}: not JSON ({e})") from None
        prompt = row.get("prompt") if isinstance(row, dict) else row
        if not isinstance(prompt, str) or not prompt:
            raise InputError(
                f'--input {path}, line {n}: expected {{"prompt": "..."}} or a JSON string, got {line[:80]!r}'
            )
        prompts.append(prompt)
    if not prompts:
        raise InputError(f"--input {path}: no prompts")
    return prompts


def cmd_generate(args: argparse.Namespace) -> int:
    from evaluation.chat import Sampling, chat

    if (args.prompt is None) == (args.input is None):
        raise InputError("give one prompt or --input FILE (not both)")
    check_device(args.device)
    prompts = [args.prompt] if args.prompt is not None else _read_prompts(args.input)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed)
    release = _load(args)
    print(f"[{release.name} on {release.manifest['backbone']['name']}, {len(release.chain)} delta(s)]", file=sys.stderr)
    if args.output is None and len(prompts) == 1:
        from transformers import TextStreamer

        chat(
            release.model,
            release.tokenizer,
            prompts,
            sampling,
            streamer=TextStreamer(release.tokenizer, skip_prompt=True, skip_special_tokens=True),
        )
        return 0
    replies = chat(release.model, release.tokenizer, prompts, sampling, batch_size=args.batch_size)
    rows = "".join(
        json.dumps({"prompt": p, "text": t, "version": release.name}) + "\n" for p, t in zip(prompts, replies)
    )
    if args.output is None:
        sys.stdout.write(rows)
    else:
        from atlas_core.io import atomic_write_bytes

        atomic_write_bytes(args.output, rows.encode())
        print(f"{len(replies)} replies -> {args.output}", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from atlas_core.export import export
    from atlas_core.release import load_folder
    from evaluation.tiny import load_model

    from .serving import release_folder

    if args.since is not None and args.format != "peft":
        raise InputError(f"--since: only --format peft exports part of a chain, not --format {args.format}")
    check_device(args.device)
    target, version = _target(args)
    with release_folder(target, version, args.backbone) as folder:
        release = load_folder(
            folder, dtype=args.dtype, device=args.device, backbone_loader=load_model, **_opt_outs(args)
        )
        if args.format == "mlflow":
            from .pyfunc import save_pyfunc

            out = save_pyfunc(release, folder, args.out, bundle_backbone=args.bundle_backbone)
        else:
            out = export(release, folder, args.format, args.out, bundle_backbone=args.bundle_backbone, since=args.since)
    print(f"{release.name} ({len(release.chain)} delta(s)) -> {out} [{args.format}]")
    return 0


EXPORT_FORMATS = ("folder", "peft", "merged")  # atlas_core.export.FORMATS; not imported (torch): --help stays instant


def add_commands(sub, common: argparse.ArgumentParser, model: argparse.ArgumentParser) -> None:
    use = argparse.ArgumentParser(add_help=False)
    use.add_argument(
        "--no-verify-backbone",
        action="store_true",
        help="load a release whose manifest names no "
        "backbone weights sha256, or whose backbone weights differ (unverified; at your own risk)",
    )
    use.add_argument(
        "--allow-legacy-folder",
        action="store_true",
        help="load a release folder written before "
        "manifest.sha256 sidecars (`atlas export --format folder` of it writes one)",
    )
    use.add_argument(
        "--device",
        default=None,
        help="torch device to run on: cpu, cuda, cuda:N, mps... (default: the CPU); checked before anything loads",
    )
    p = sub.add_parser(
        "generate",
        parents=[common, model, use],
        help="generate with a release (chat template, greedy by default, streamed)",
    )
    p.add_argument("prompt", nargs="?", default=None, help="one user message (or --input)")
    p.add_argument(
        "--version",
        default="champion",
        help="champion (default), base, a version name, mlflow:<n>, #<id>, an MLflow model URI or a release folder",
    )
    p.add_argument("--input", default=None, help='JSONL of prompts: {"prompt": ...} per line')
    p.add_argument("--output", default=None, help="JSONL of replies (default: stdout)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch with --input")
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser(
        "export",
        parents=[common, model, use],
        help="export a release: a PEFT adapter, merged weights or the release folder",
    )
    p.add_argument("version", help="champion, base, a version name, mlflow:<n>, #<id>, an MLflow model URI or a folder")
    p.add_argument(
        "--format",
        required=True,
        choices=(*EXPORT_FORMATS, "mlflow"),
        help="folder | peft | merged | mlflow (a pyfunc model folder for `mlflow models serve -m DIR`)",
    )
    p.add_argument("--out", required=True, help="a new (or empty) folder")
    p.add_argument(
        "--bundle-backbone",
        action="store_true",
        help="folder, mlflow: copy the backbone's weights in too (air-gapped serving)",
    )
    p.add_argument(
        "--since",
        default=None,
        metavar="VERSION",
        help="peft: only the deltas added after VERSION (a "
        "version of the chain), to load on top of load_release(LINE, VERSION).model",
    )
    p.set_defaults(func=cmd_export)
