"""What `--help` tells a newcomer: where the ledger and the broker are (from the settings registry, with
their defaults), what `--max-new-tokens` decodes when it is not given, the log levels a worker takes;
and counts said in words that agree with them ("1 job")."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from dsocr_workers import settings
from dsocr_workers.cli import main
from dsocr_workers.model.families import all_presets


def help_of(*command: str) -> str:
    result = CliRunner().invoke(main, [*command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())  # click wraps the option help: compare words


@pytest.mark.parametrize("command", [(), ("submit",), ("worker",)])
def test_help_names_the_ledger_and_the_broker_with_their_defaults(command):
    text = help_of(*command)
    for variable in (settings.DATABASE_URL, settings.BROKER_URL):
        assert f"{variable.name} (default {variable.default}): {variable.doc}" in text


def test_max_new_tokens_says_what_is_decoded_without_it():
    ceilings = {config.text.max_position_embeddings for name, family in all_presets().items() for config in [family.presets[name]]}
    assert ceilings == {8192}  # the help names one ceiling: every preset has it
    for command in ("submit", "run"):
        assert ("Default: no cap, until EOS or the model's position ceiling (8,192); random weights (the presets) "
                "seldom emit EOS and decode to that ceiling.") in help_of(command)  # fmt: skip


def test_loglevel_lists_its_choices_and_refuses_others():
    assert "--loglevel [debug|info|warning|error|critical]" in help_of("worker")
    refused = CliRunner().invoke(main, ["worker", "--gpus", "cpu", "--loglevel", "LOUD"])
    assert refused.exit_code == 2 and "'LOUD' is not one of" in refused.output


def test_a_worker_told_of_an_unknown_prefill_is_refused():
    refused = CliRunner().invoke(main, ["worker", "--gpus", "cpu", "--concurrency", "4", "--prefill", "chunks"])
    assert refused.exit_code == 2 and "'chunks' is not one of 'split', 'whole'" in refused.output


def test_one_job_is_one_job(tmp_path, make_png, subprocess_env):
    make_png("only.png", folder=tmp_path)
    (tmp_path / "list.txt").write_text("only.png\n")
    env = {**subprocess_env, "DSOCR_DATABASE_URL": f"sqlite:///{tmp_path / 'd.db'}"}
    done = subprocess.run(
        [sys.executable, "-m", "dsocr_workers", "run", str(tmp_path / "list.txt"), "--mode", "tiny",
         "--max-new-tokens", "2", "--format", "json"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert any(line.startswith("run ") and line.endswith(": 1 job on cpu") for line in done.stderr.splitlines()), (
        done.stderr
    )
