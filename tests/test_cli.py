"""Every `atlas` command on a tiny model and a temporary state dir, and its bad-input path: one
line on stderr ("atlas COMMAND: error: ...") and exit status 2, with nothing written."""

from __future__ import annotations

import json

import pytest

from tests.flows_fixtures import IMPOSSIBLE_POLICY, PASSING_POLICY, tiny_files, write_yaml

LINE = ["--model", "tiny-llama.tiny-code"]
ONE_CANDIDATE = PASSING_POLICY | {"candidates": {"methods": ["atlas"], "seeds": [0]}}


def atlas(capsys, *argv: str) -> tuple[int, str, str]:
    from flows.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def bad(capsys, command: str, *argv: str, says: str) -> None:
    """The command fails on bad input with exit 2 and one error line naming what was wrong."""
    code, _, err = atlas(capsys, command, *argv)
    lines = [line for line in err.splitlines() if line.startswith("atlas ")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"atlas {command}: error: "), err[-2000:]
    assert says in lines[0], lines[0]


def assert_local_prefect_status_reads_the_same_runs(tmp_path) -> None:
    """Without PREFECT_API_URL (local mode) `atlas status` reads Prefect's database in-process:
    the same lines as through the server's API, no client (which would start a temporary server),
    and no database created where there is none."""
    from unittest import mock

    from prefect.server.database.dependencies import temporary_database_config
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, PREFECT_API_URL, temporary_settings

    from flows.prefect_runs import prefect_status

    served = prefect_status(5)
    assert "COMPLETED" in served.upper(), served
    with (
        temporary_settings(restore_defaults={PREFECT_API_URL}),
        mock.patch("prefect.client.orchestration.get_client", side_effect=AssertionError("client used")),
    ):
        assert prefect_status(5) == served
        missing = tmp_path / "no-prefect" / "prefect.db"
        with (
            temporary_settings(updates={PREFECT_API_DATABASE_CONNECTION_URL: f"sqlite+aiosqlite:///{missing}"}),
            temporary_database_config(None),
        ):  # Prefect keeps a process's first database config
            assert "COMPLETED" not in prefect_status(5).upper()
        assert not missing.exists()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    """The tiny Llama and its tokenizer saved as a local model folder (what `--backbone DIR` loads)."""
    from evaluation.tiny import tiny_llama, tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny-model")
    tokenizer = tiny_tokenizer()
    model = tiny_llama(len(tokenizer), hidden_size=64, layers=4)
    model.config.max_position_embeddings = 2048
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_method_commands_on_a_local_tiny_model(state, tmp_path, capsys, tiny_folder):
    common = ["--backbone", tiny_folder, "--dtype", "float32"]
    code, out, _ = atlas(capsys, "backbone", *common)
    assert code == 0 and "layers     4 (middle 2)" in out and "hidden     64" in out
    fit = ["--num-vectors", "64", "--charts", "4", "--rank", "4"]
    code, out, _ = atlas(capsys, "fit-atlas", *common, *fit, "--out", str(tmp_path / "a.safetensors"))
    assert code == 0 and (tmp_path / "a.safetensors").is_file() and (tmp_path / "a.json").is_file()
    code, out, _ = atlas(capsys, "demo", *common, *fit, "--contexts", "4")
    assert code == 0 and "adapted logits equal the base model's exactly: True" in out

    bad(capsys, "backbone", "--backbone", str(tmp_path / "no-such-model"), says="no-such-model")
    bad(capsys, "fit-atlas", *common, *fit, "--layer", "9", says="layer")


def test_release_commands_on_a_tiny_line(prefect_harness, state, tmp_path, capsys):
    config, policy = tiny_files(tmp_path / "cfg", ONE_CANDIDATE)
    code, out, _ = atlas(capsys, "update", "--config", config, "--policy", policy)
    assert code == 0 and "PROMOTED tiny-llama-tiny-code-atlas-s0" in out and "time:       lineage" in out, out
    champion = out.split("PROMOTED ")[1].split()[0]

    code, out, _ = atlas(capsys, "status", *LINE, "--no-prefect")
    assert code == 0 and f"champion   {champion}" in out and "PASS" in out
    code, out, _ = atlas(capsys, "status", *LINE)  # with the Prefect query: the cycle's flow run
    assert code == 0 and "Prefect (flow 'update'):" in out and "COMPLETED" in out.upper()
    assert_local_prefect_status_reads_the_same_runs(tmp_path)
    code, out, _ = atlas(capsys, "compare", *LINE, "base", "champion", "--format", "json")
    compared = json.loads(out)
    assert code == 0 and compared["version_b"] == champion and compared["version_a"].endswith("-base")
    code, out, _ = atlas(capsys, "history", *LINE)
    assert code == 0 and "promote" in out and champion in out and "R[t][i]" in out
    code, out, _ = atlas(capsys, "gate", *LINE, "--explain", "champion", "--json")
    assert code == 0 and json.loads(out)["passed"] is True and json.loads(out)["version"] == champion
    code, out, _ = atlas(capsys, "gate", *LINE, "--explain", champion)
    assert code == 0 and out.startswith(f"{champion}: PASS") and "ok   kl_vs_champion[gsm8k]" in out

    code, out, _ = atlas(capsys, "update", "--config", config, "--policy", policy)
    assert code == 0 and "idle" in out  # nothing new: the rerun writes nothing
    code, out, _ = atlas(capsys, "rollback", *LINE, "--reason", "cli test")
    assert code == 0 and "rolled back" in out
    bad(capsys, "rollback", *LINE, "--reason", "again", says="champion")  # nobody holds it any more
    code, out, _ = atlas(capsys, "renominate", *LINE, champion, "--reason", "fixed")
    assert code == 0 and "re-nominated" in out
    bad(capsys, "renominate", *LINE, champion, "--reason", "twice", says="retired")  # it is active now

    bad(capsys, "status", "--model", "no.such-line", "--no-prefect", says="no.such-line")
    bad(capsys, "compare", *LINE, "base", "v-nope", says="'v-nope' matches 0 versions")
    bad(capsys, "gate", *LINE, "--explain", "#999", says="'#999' matches 0 versions")
    bad(capsys, "history", "--model", "no.such-line", says="run `atlas update` first")


def test_cycle_commands_reject_bad_files_before_anything_runs(state, tmp_path, capsys):
    config, policy = tiny_files(tmp_path / "cfg", IMPOSSIBLE_POLICY)
    typo = write_yaml(tmp_path / "typo.yaml", IMPOSSIBLE_POLICY | {"max_kl_vs_champoin": {"gsm8k": 0.1}})
    for command, *one in (("update",), ("serve", "--deployment", "update")):
        bad(capsys, command, *one, "--config", str(tmp_path / "missing.yaml"), "--policy", policy, says="missing.yaml")
        bad(capsys, command, *one, "--config", config, "--policy", typo, says="max_kl_vs_champoin")
        bad(
            capsys,
            command,
            *one,
            "--config",
            config,
            "--policy",
            policy,
            "--snapshot",
            str(tmp_path / "none.jsonl"),
            says="none.jsonl",
        )
    bad(capsys, "serve", "--config", config, says="apply to one deployment")  # two scheduled lines: which one?
    bad(capsys, "serve", "--deployment", "nope", says="no deployment named 'nope'")
    assert not (state / "ledger.db").exists()  # nothing was opened or written
