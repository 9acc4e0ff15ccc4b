"""`rlx --help` and every command's --help: listed, explained, defaults shown, no torch at import."""

from __future__ import annotations

import re
import subprocess
import sys

import click
import pytest
import typer

from rlx.cli import app
from tests.conftest import cli

COMMANDS = ["shard", "sft", "rollout", "score", "train-step", "merge", "eval", "ppo", "report"]


def click_command(name: str) -> click.Command:
    return typer.main.get_command(app).commands[name]


def test_top_level_help_lists_every_command():
    result = cli("--help")
    assert result.exit_code == 0
    for name in COMMANDS:
        assert re.search(rf"^\s+{name}\s", result.stdout, re.M), name


def test_version():
    from rlx import __version__

    result = cli("--version")
    assert result.exit_code == 0 and result.stdout == f"rlx {__version__}\n"
    out = subprocess.run([sys.executable, "-m", "rlx", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"rlx {__version__}" and "--version" in cli("--help").stdout


def test_cli_import_does_not_import_torch():
    """--help must be instant: the CLI module and all command modules stay torch-free at import."""
    code = "import sys, rlx.cli; print([m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_module_entry_point_help_runs():
    out = subprocess.run([sys.executable, "-m", "rlx", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train-step" in out.stdout


@pytest.mark.parametrize("name", COMMANDS)
def test_command_help_explains_every_option(name):
    result = cli(name, "--help")
    assert result.exit_code == 0 and "Usage: rlx" in result.stdout
    command = click_command(name)
    assert command.help and len(command.help.split()) >= 8, f"{name} needs a description"
    for param in command.params:
        assert param.help and len(param.help.split()) >= 3, f"{name} {param.opts} has no explanation"
        if isinstance(param, click.Option) and not param.required and param.default is not None:
            assert param.show_default is not False, f"{name} {param.opts} hides its default"
        flag = param.opts[0]
        assert flag in result.stdout or param.name.upper() in result.stdout.upper()


@pytest.mark.parametrize(
    "name,option,default",
    [
        ("rollout", "--n", "1"),
        ("rollout", "--temperature", "1.0"),
        ("score", "--estimator", "grpo"),
        ("train-step", "--lr", "1e-06"),
        ("train-step", "--micro-batch-size", "8"),
        ("shard", "--layout", "single"),
    ],
)
def test_help_shows_defaults(name, option, default):
    text = " ".join(cli(name, "--help").stdout.split("Options:")[1].split()).replace("- ", "-")
    start = re.search(re.escape(option) + "[ ,]", text).start()
    assert f"[default: {default}]" in text[start : start + 400]
