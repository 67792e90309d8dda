"""`atlas`: the platform's command line.

Method commands (flows/cli_method.py): backbone, fit-atlas, demo, eval-base.
Release commands (flows/cli_release.py): update, serve, status, compare, history, rollback, gate.
Each command imports what it needs when it runs, so `atlas --help` stays instant.
"""
from __future__ import annotations

import argparse
import sys

from .platform import configure_environment

DTYPES = ("auto", "float32", "bfloat16")  # atlas_core.backbone.DTYPES; not imported: --help stays instant


def _method(name: str):
    """A method command, imported when it runs."""

    def run(args: argparse.Namespace) -> int:
        from . import cli_method

        return getattr(cli_method, name)(args)

    return run


def add_fit_args(p: argparse.ArgumentParser) -> None:
    from .cli_method import _add_fit_args  # argparse only; torch is imported by the commands

    _add_fit_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atlas", description="The continual-update platform: ATLAS residuals, "
                                     "retained-KL gates, versioned releases.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backbone", default="smollm2-135m", help="built-in alias, local folder or hub id (default: %(default)s)")
    common.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="model dtype; auto: bfloat16 where the hardware has it natively, else float32 (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("backbone", parents=[common], help="load (and on first use convert) the backbone; print what it is")
    p.set_defaults(func=_method("cmd_backbone"))

    p = sub.add_parser("fit-atlas", parents=[common], help="extract layer-l activations from retained contexts and fit an atlas")
    add_fit_args(p)
    p.add_argument("--out", default=None, help="atlas file (.safetensors; a .json manifest is written beside it)")
    p.set_defaults(func=_method("cmd_fit_atlas"))

    p = sub.add_parser("demo", parents=[common], help="fit an atlas, attach an ATLAS residual, check B=0 is exact, measure retained KL")
    add_fit_args(p)
    p.add_argument("--contexts", type=int, default=16, help="GSM8K contexts for the KL check")
    p.add_argument("--b-std", type=float, default=0.01, help="std of the random B for the KL check")
    p.set_defaults(func=_method("cmd_demo"), num_vectors=1024)

    p = sub.add_parser("eval-base", parents=[common], help="score the base model on a small subset of every set")
    p.add_argument("--limit", type=int, default=16, help="first N problems of each set")
    p.add_argument("--layer", type=int, default=-1, help="prefix-cache layer of the KL reference (-1: middle)")
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.set_defaults(func=_method("cmd_eval_base"))

    from .cli_release import add_commands

    add_commands(sub, common)
    return parser


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input or state, shown as one line instead of a traceback."""
    errors: list[type[BaseException]] = [ValueError, FileNotFoundError, ModuleNotFoundError]
    if "registry" in sys.modules:
        import registry

        errors += [registry.LedgerError, registry.PromotionError, registry.ArtifactError]
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    configure_environment()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as e:
        if not isinstance(e, _expected_errors()):
            raise
        print(f"atlas {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
