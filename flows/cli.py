"""`atlas`: the platform's command line.

Method commands (flows/cli_method.py): backbone, fit-atlas, demo, eval-base.
Cycle commands (flows/cli_release.py): update, serve, submit, gate check.
Operational commands (flows/cli_ops.py): status, compare, history, gate --explain, rollback, renominate.
Each command imports what it needs when it runs, so `atlas --help` stays instant.

Errors: bad input (`atlas_core.errors.InputError`, a stored file failing its check, the registry's
refusals, a path that is missing or unreadable) is one line `atlas CMD: error: ...` on stderr and
exit status 2; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from contextlib import contextmanager
from typing import Iterator

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
    parser = argparse.ArgumentParser(
        prog="atlas",
        description="The continual-update platform: ATLAS residuals, retained-KL gates, versioned releases.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--backbone", default="smollm2-135m", help="built-in alias, local folder or hub id (default: %(default)s)"
    )
    common.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="model dtype; auto: bfloat16 where the hardware has it natively, else float32 (default: %(default)s)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "backbone", parents=[common], help="load (and on first use convert) the backbone; print what it is"
    )
    p.set_defaults(func=_method("cmd_backbone"))

    p = sub.add_parser(
        "fit-atlas", parents=[common], help="extract layer-l activations from retained contexts and fit an atlas"
    )
    add_fit_args(p)
    p.add_argument("--out", default=None, help="atlas file (.safetensors; a .json manifest is written beside it)")
    p.set_defaults(func=_method("cmd_fit_atlas"))

    p = sub.add_parser(
        "demo", parents=[common], help="fit an atlas, attach an ATLAS residual, check B=0 is exact, measure retained KL"
    )
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


# A file-system error on a path is the user's to fix (a path given that is missing, unreadable, a
# folder, ...); other OSErrors (a lost connection, a broken pipe) are not input and keep their traceback.
_FILE_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def _expected_errors() -> tuple[type[BaseException], ...]:
    """The error classes that mean bad input or state, shown as one line instead of a traceback:
    InputError (a config, policy, data file, option or flag; SchemaError and ConfigError are ones),
    a stored file that fails its check (atlas_core.io.IntegrityError), the registry's refusals (an
    unknown line or version, a promotion or rollback that is not allowed, a missing artifact).
    A module not imported yet cannot have raised its class; importing it here would cost seconds."""
    from atlas_core.errors import InputError

    errors: list[type[BaseException]] = [InputError, *_FILE_ERRORS]
    if "atlas_core.io" in sys.modules:
        errors.append(sys.modules["atlas_core.io"].IntegrityError)
    registry = sys.modules.get("registry")
    for name in ("LedgerError", "PromotionError", "ArtifactError"):
        if hasattr(registry, name):
            errors.append(getattr(registry, name))
    return tuple(errors)


def is_expected(error: BaseException) -> bool:
    """Whether `error` is bad input (one line, exit 2) rather than a bug (a traceback)."""
    return isinstance(error, _expected_errors()) or (isinstance(error, OSError) and error.filename is not None)


def one_line(error: BaseException) -> str:
    """The error's message on one line; an OSError names its path and the OS's reason."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        paths = f"{error.filename} -> {error.filename2}" if error.filename2 is not None else str(error.filename)
        text = f"{paths}: {error.strerror}"
    else:
        text = str(error) or type(error).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


class _NoTracebackForExpected(logging.Filter):
    """Prefect logs a failed flow or task run with its traceback ("Encountered exception during
    execution", "Task run failed with exception"); for bad input the CLI prints one line instead,
    so such a record keeps its message and loses the traceback. Other errors keep theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if isinstance(record.exc_info, tuple) else None
        if error is not None and is_expected(error):
            record.exc_info, record.exc_text = None, None
        return True


# Where Prefect's engines log flow and task run failures (prefect.logging.loggers: flow_run_logger,
# task_run_logger); a filter on a logger runs before any of its handlers (console and API alike).
PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


@contextmanager
def _quiet_prefect_tracebacks() -> Iterator[None]:
    """While one command runs: no Prefect traceback for an expected error raised inside a flow."""
    quiet = _NoTracebackForExpected()
    loggers = [logging.getLogger(name) for name in PREFECT_RUN_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


def main(argv: list[str] | None = None) -> int:
    configure_environment()
    args = build_parser().parse_args(argv)
    try:
        with _quiet_prefect_tracebacks():
            return args.func(args)
    except Exception as e:
        if not is_expected(e):
            raise
        print(f"atlas {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
