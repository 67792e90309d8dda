"""`atlas` errors and the operational commands' cost.

- Bad input of every expected class (InputError and its ConfigError / SchemaError /
  DataIntegrityError, a stored file failing its check, the registry's refusals, a file-system
  error on a path) is one stderr line `atlas CMD: error: ...` and exit 2; anything else (a bare
  ValueError from inside, a lost connection) keeps its traceback.
- A bad --device is one line before any model loads.
- An InputError raised inside a Prefect flow run leaves no Prefect traceback; a bug keeps it.
- status, history, compare, gate --explain, rollback and renominate import neither Prefect
  nor torch (a flow run would start Prefect's temporary server: 16-20 s), and rollback of a line
  that nobody holds `champion` of is one line, exit 2.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    from flows.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def failing_history(monkeypatch, error: BaseException) -> None:
    """`atlas history` raises `error` (the parser binds the command when main builds it)."""
    import flows.cli_ops

    def fail(args):
        raise error

    monkeypatch.setattr(flows.cli_ops, "cmd_history", fail)


def one_error_line(capsys, command: str, *argv: str) -> str:
    """Run a command that must fail on bad input: exit 2, exactly one stderr line; returns it."""
    code, _, err = run_main(capsys, command, *argv)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"atlas {command}: error: "), (code, err[-3000:])
    return lines[0]


def expected_errors() -> list[BaseException]:
    import registry
    from atlas_core.errors import InputError
    from atlas_core.io import IntegrityError
    from atlas_core.typed_config import ConfigError
    from evaluation.datafiles import DataIntegrityError
    from evaluation.userdata import SchemaError

    return [
        InputError("--flag: bad value"),
        ConfigError("policy.yaml: field 'x' unknown"),
        SchemaError("rows.jsonl: line 2: field 'prompt' is missing"),
        DataIntegrityError("gsm8k/test.jsonl: sha256"),
        IntegrityError("adapter.safetensors: sha256 differs"),
        registry.LedgerError("no model 'x'"),
        registry.PromotionError("nobody holds 'champion'"),
        registry.RollbackError("nothing to roll back"),
        registry.ArtifactMissingError("artifact abc missing", "/store/ab/abc", "abc"),
    ]


@pytest.mark.parametrize("index", range(9))
def test_each_expected_error_class_is_one_line_exit_2(monkeypatch, capsys, index):
    error = expected_errors()[index]
    failing_history(monkeypatch, error)
    line = one_error_line(capsys, "history")
    assert line == f"atlas history: error: {error}"


def test_a_multi_line_message_is_still_one_line(monkeypatch, capsys):
    from atlas_core.errors import InputError

    failing_history(monkeypatch, InputError("config.yaml: two problems\n  field a\n  field b"))
    assert one_error_line(capsys, "history").endswith("two problems field a field b")


@pytest.mark.parametrize("kind", ["missing", "folder", "not-a-folder", "permission"])
def test_file_system_errors_on_a_user_path_name_the_path_and_the_reason(monkeypatch, capsys, tmp_path, kind):
    """Real OSErrors from the OS (the permission one made by hand: tests may run as root)."""
    (tmp_path / "file.txt").write_text("x")
    path, reason = {
        "missing": (tmp_path / "nope.yaml", "No such file or directory"),
        "folder": (tmp_path, "Is a directory"),
        "not-a-folder": (tmp_path / "file.txt" / "inside.yaml", "Not a directory"),
        "permission": (tmp_path / "file.txt", "Permission denied"),
    }[kind]
    if kind == "permission":
        error = PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    else:
        try:
            path.read_text()
        except OSError as e:
            error = e
    failing_history(monkeypatch, error)
    assert one_error_line(capsys, "history") == f"atlas history: error: {path}: {reason}"


@pytest.mark.parametrize(
    "error",
    [ValueError("an internal invariant broke"), KeyError("k"), ConnectionError("peer went away"), RuntimeError("bug")],
)
def test_other_errors_keep_their_traceback(monkeypatch, capsys, error):
    failing_history(monkeypatch, error)
    from flows.cli import main

    with pytest.raises(type(error)):
        main(["history"])
    assert "error:" not in capsys.readouterr().err


def test_real_bad_input_of_commands_is_one_line(state, capsys, tmp_path):
    """A few real paths: a folder as --input, a missing config, a typo'd policy field."""
    one_error_line(capsys, "generate", "--input", str(tmp_path))
    line = one_error_line(capsys, "update", "--config", str(tmp_path / "missing.yaml"))
    assert "missing.yaml" in line
    line = one_error_line(capsys, "gate")
    assert "--explain" in line
    # Without --config/--policy the documented defaults apply (`atlas serve`'s None defaults once
    # leaked into `atlas update` through argparse's shared parent actions: a TypeError traceback).
    line = one_error_line(capsys, "update", "--snapshot", str(tmp_path / "none.jsonl"))
    assert "--snapshot" in line and "none.jsonl" in line


def test_update_and_serve_keep_their_own_defaults():
    from flows.cli import build_parser
    from flows.platform import DEFAULT_CONFIG, DEFAULT_POLICY

    update = build_parser().parse_args(["update"])
    assert (update.config, update.policy) == (DEFAULT_CONFIG, DEFAULT_POLICY)
    serve = build_parser().parse_args(["serve"])
    assert (serve.config, serve.policy) == (None, None)  # each deployment's own


@pytest.mark.parametrize(
    "device, says",
    [
        ("gpu7", "not a torch device"),
        ("cuda", "no cuda device"),
        ("cuda:3", "no cuda device"),
        ("cpu:x", "not a torch device"),
    ],
)
def test_a_bad_device_is_one_line_before_any_model_loads(monkeypatch, state, capsys, tmp_path, device, says):
    import torch

    import flows.serving

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer with or without a GPU
    monkeypatch.setattr(flows.serving, "load_release", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(flows.serving, "release_folder", lambda *a, **k: pytest.fail("a release was opened"))
    line = one_error_line(capsys, "generate", "--device", device, "hello")
    assert (f"--device {device}:" in line or f"--device {device!r}:" in line) and says in line, line
    line = one_error_line(
        capsys, "export", "champion", "--format", "peft", "--out", str(tmp_path / "o"), "--device", device
    )
    assert says in line, line


def test_device_counts_are_checked(monkeypatch):
    import torch

    from atlas_core.errors import InputError
    from flows.cli_use import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda:1") == "cuda:1" and check_device("cuda") == "cuda" and check_device(None) is None
    with pytest.raises(InputError, match=r"--device cuda:2: this machine has 2 cuda device\(s\), cuda:0 to cuda:1"):
        check_device("cuda:2")
    assert check_device("cpu") == "cpu"


def test_export_formats_match_the_exporter():
    from atlas_core.export import FORMATS
    from flows.cli_use import EXPORT_FORMATS

    assert EXPORT_FORMATS == FORMATS


# ------------------------------------------------------------------ Prefect's flow-run logs
class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(logging.Formatter().format(record))


def test_the_filter_drops_only_expected_tracebacks():
    from atlas_core.errors import InputError
    from flows.cli import PREFECT_RUN_LOGGERS, _quiet_prefect_tracebacks

    for name in PREFECT_RUN_LOGGERS:
        logger, sink = logging.getLogger(name), Collect()
        logger.addHandler(sink)
        try:
            with _quiet_prefect_tracebacks():
                for error in (InputError("--x: bad"), ValueError("internal")):
                    try:
                        raise error
                    except ValueError as e:
                        logger.error("Encountered exception during execution: %r", e, exc_info=True)
            try:
                raise InputError("--x: outside the CLI")
            except ValueError as e:
                logger.error("failed: %r", e, exc_info=True)
        finally:
            logger.removeHandler(sink)
        quiet, bug, outside = sink.texts
        assert "InputError('--x: bad')" in quiet and "Traceback" not in quiet
        assert "Traceback" in bug and "Traceback" in outside  # a bug, and any use outside the CLI, keep theirs


def _flow_failing_with(error_class: type[Exception]):
    from prefect import flow, task

    @task(retries=0)
    def check() -> None:
        raise error_class("data.source: no training pairs in my.jsonl")

    @flow(name="fails-inside")
    def fails_inside() -> None:
        check()

    return fails_inside


def test_no_prefect_traceback_for_bad_input_inside_a_flow_run(prefect_harness, monkeypatch, capsys):
    from atlas_core.errors import InputError
    from flows.cli import PREFECT_RUN_LOGGERS, main

    sinks = {name: Collect() for name in PREFECT_RUN_LOGGERS}
    for name, sink in sinks.items():
        logging.getLogger(name).addHandler(sink)
    try:
        monkeypatch.setattr("flows.cli_ops.cmd_history", lambda args: _flow_failing_with(InputError)())
        assert one_error_line(capsys, "history").endswith("data.source: no training pairs in my.jsonl")
        logged = [t for sink in sinks.values() for t in sink.texts]
        assert any("InputError" in t for t in logged), logged  # Prefect still says what failed, in one line
        assert not any("Traceback" in t for t in logged), logged
        for sink in sinks.values():
            sink.texts.clear()
        monkeypatch.setattr("flows.cli_ops.cmd_history", lambda args: _flow_failing_with(RuntimeError)())
        with pytest.raises(RuntimeError):
            main(["history"])
        assert any("Traceback" in t for sink in sinks.values() for t in sink.texts)  # a bug keeps it
    finally:
        for name, sink in sinks.items():
            logging.getLogger(name).removeHandler(sink)


# ------------------------------------------------------------------ operational commands
def tiny_line(state_dir: Path) -> tuple[str, str]:
    """A ledger with one line: two versions, the first promoted (ledger only) with a passing gate
    decision; returns (the registered model's name, the champion's name)."""
    import registry as r
    from tests.conftest_registry import gate_pass, make_candidates

    state_dir.mkdir(parents=True, exist_ok=True)
    with r.init_db(r.default_ledger_url(state_dir)) as ledger:
        model_id, versions = make_candidates(
            ledger, r.ArtifactStore(state_dir / "artifacts"), "tests/tiny-ops", skill="code", seeds=(0, 1)
        )
        gate_pass(ledger, versions[0].id, None)
        r.promote(ledger, None, versions[0].id, reason="first", expected_current=None)
        return r.get_model(ledger, model_id).name, versions[0].name


OPS_PROBE = r"""
import contextlib, io, json, sys, time
import flows.cli  # what every `atlas` command imports before it runs
before = set(sys.modules)
flows.cli.build_parser()  # what `atlas --help` costs on top: argparse only
parser = sorted(set(sys.modules) - before)
before = set(sys.modules)
out = []
for argv in json.loads(sys.argv[1]):
    stdout, stderr = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = flows.cli.main(argv)
    out.append({"argv": argv, "code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(),
                "seconds": round(time.perf_counter() - start, 2)})
new = sorted(set(sys.modules) - before)
print(json.dumps({"runs": out, "prefect": "prefect" in sys.modules, "parser": parser,
                  "heavy": [m for m in new if m.split(".")[0] in ("prefect", "torch", "transformers", "datasets")]}))
"""


def test_operational_commands_start_no_prefect_and_import_no_torch(tmp_path):
    """One process runs every operational command in turn (as `atlas` would, one by one): none of
    them imports Prefect (no flow run, no temporary server) or torch; rollback moves the champion
    back to the base, a second rollback is one line with exit 2, renominate lifts the retirement."""
    state = tmp_path / "state"
    model, version = tiny_line(state)
    m = ["--model", model]
    argv = [
        ["status", *m],
        ["history", *m],
        ["gate", *m, "--explain", "champion"],
        ["compare", *m, "base", "champion"],
        ["rollback", *m, "--reason", "users report a regression"],
        ["rollback", *m, "--reason", "again"],
        ["renominate", *m, version, "--reason", "fixed"],
        ["history", *m],
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "ATLAS_"))}
    env |= {"ATLAS_STATE_DIR": str(state), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", OPS_PROBE, json.dumps(argv)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.splitlines()[-1])
    assert probe["heavy"] == [] and not probe["prefect"], probe["heavy"]
    assert not [
        m
        for m in probe["parser"]
        if m.split(".")[0] in ("torch", "prefect", "mlflow", "registry", "atlas_core") and m != "atlas_core.errors"
    ], probe["parser"]  # `atlas --help` stays instant
    status, history, explain, compare, rollback, again, renominate, after = probe["runs"]
    assert status["code"] == 0 and f"champion   {version}" in status["stdout"], status
    assert "atlas status --prefect" in status["stdout"]  # local mode: Prefect not read, and how to read it
    assert history["code"] == 0 and version in history["stdout"] and "R[t][i]" in history["stdout"], history
    assert explain["code"] == 0 and explain["stdout"].startswith(f"{version}: PASS"), explain
    assert compare["code"] == 0, compare
    assert rollback["code"] == 0 and "champion rolled back to" in rollback["stdout"] and rollback["stderr"] == ""
    assert again["code"] == 2 and again["stdout"] == "", again
    assert again["stderr"].splitlines() == [
        f"atlas rollback: error: {model}: nobody holds 'champion' (the base serves); nothing to roll back"
    ], again
    assert renominate["code"] == 0 and "re-nominated" in renominate["stdout"], renominate
    assert after["code"] == 0 and "rollback" in after["stdout"] and "renominate" in after["stdout"], after
    print({r["argv"][0]: r["seconds"] for r in probe["runs"]})


def test_the_rollback_flow_and_the_cli_share_one_function():
    """deploy/prefect.yaml's rollback flow moves the alias with the CLI's own plain function."""
    import inspect

    from flows import release

    assert "rollback_champion" in inspect.getsource(release.rollback.fn)
