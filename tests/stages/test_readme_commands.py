"""The README's commands work verbatim on a fresh clone: the "one GRPO step by hand" block runs as written (`rlx`
lines through this process's rlx, `python` through this interpreter), and the guides' one-line commands that a new
user copies first name options and files that exist."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, cli

SHELL_SYNTAX = re.compile(r"""[|&;<>$`(){}*?~\\'"]""")  # what only a shell would read: such lines go to bash


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def block_under(heading: str) -> str:
    section = (REPO / "README.md").read_text().split(heading, 1)[1]
    return bash_blocks(section)[0]


def command_lines(block: str) -> list[str]:
    """The block's commands, continuation lines joined and comments dropped."""
    joined = block.replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


@pytest.mark.slow
def test_the_grpo_step_by_hand_runs_verbatim(tmp_path, monkeypatch):
    """Each `rlx` line that is one plain command (no pipe, redirection or variable) runs in this process, from its
    words as the shell splits them (no interpreter start-up each); the others through the shell."""
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    ran = 0
    for line in command_lines(block_under("## One GRPO step by hand")):
        if line.startswith("jq ") and shutil.which("jq") is None:
            continue
        if line.startswith("rlx ") and not SHELL_SYNTAX.search(line):
            result = cli(*shlex.split(line)[1:])
            assert result.exit_code == 0, f"{line}\n{result}"
        else:
            line = re.sub(
                r"^(rlx|python) ", lambda m: f"{sys.executable} " + ("-m rlx " if m[1] == "rlx" else ""), line
            )
            done = subprocess.run(line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        ran += 1
    assert ran >= 7
    assert (tmp_path / "hf-model" / "config.json").exists()
    assert (tmp_path / "eval1" / "eval.jsonl").exists()


def test_the_guides_commands_name_existing_recipes_and_scripts():
    texts = [(REPO / "README.md").read_text(), *(p.read_text() for p in (REPO / "docs").glob("*.md"))]
    named = {m for text in texts for m in re.findall(r"\b((?:recipes|bench)/[\w./-]+\.(?:toml|sh|py|sbatch))", text)}
    assert named, "no recipe or bench script named"
    missing = sorted(path for path in named if not (REPO / path).exists())
    assert not missing, missing


def test_the_slurm_dry_run_line_of_the_guide_runs():
    guide = (REPO / "docs" / "running.md").read_text()
    line = re.search(r"`(RLX_DRY_RUN=1 [^`]+)`", guide)[1]
    done = subprocess.run(line, shell=True, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "torchrun" in done.stdout
