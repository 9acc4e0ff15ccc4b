"""`rlx --help` and every command's --help: listed, explained, defaults shown, no torch at import."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer

from rlx.cli import app
from tests.conftest import REPO, cli

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


OLDEST_CLI = Path(sys.prefix) / "oldest-cli"
"""typer and click at pyproject's floors (`make setup-test` installs them there with pip --target)."""

_UNDER_OLDEST = """
import importlib.metadata, sys, click, typer.main
from typer.testing import CliRunner
from rlx.cli import app
print(typer.__version__, importlib.metadata.version("click"))
group = typer.main.get_command(app)
for name, command in group.commands.items():
    result = CliRunner().invoke(app, [name, "--help"])
    assert result.exit_code == 0 and "Usage:" in result.output, (name, result.output)
    for param in command.params:
        assert all(o == o.lower() for o in param.opts if o.startswith("--")), (name, param.opts)
result = CliRunner().invoke(app, ["shard", "--model", sys.argv[1], "--out", sys.argv[2], "--dtype", "bfloat16"])
assert "No such option" not in result.output and "model not found" in result.output, result.output
"""


@pytest.mark.skipif(not OLDEST_CLI.is_dir(), reason="no typer/click at the floors (make setup-test installs them)")
def test_every_command_parses_under_the_oldest_supported_typer_and_click(tmp_path):
    """typer 0.27 under click 8.5 named an option after a metavar spelling its name in capitals (--DTYPE)."""
    env = {**os.environ, "PYTHONPATH": f"{OLDEST_CLI}{os.pathsep}{REPO}"}
    args = [sys.executable, "-c", _UNDER_OLDEST, str(tmp_path / "missing"), str(tmp_path / "out")]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    floors = re.findall(r'"(typer|click)>=([\d.]+)"', (REPO / "pyproject.toml").read_text())
    assert out.stdout.split() == [version for _, version in sorted(floors, reverse=True)]  # typer, click
