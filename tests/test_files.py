"""Shipped files stay what their generators make, and the README's file tree lists the repository."""

from __future__ import annotations

import json
import re
import subprocess

from rlx.models.tiny import write_tiny_model_dir
from rlx.tasks.arith import generate_arith
from tests.conftest import REPO, read_jsonl


def test_shipped_task_data_matches_the_generator():
    assert read_jsonl(REPO / "recipes/data/arith_quickstart.jsonl") == generate_arith(1000, seed=0, max_value=4)
    assert read_jsonl(REPO / "recipes/data/arith_chat.jsonl") == generate_arith(
        4000, seed=0, max_value=20, ops="+-", style="chat"
    )


def test_shipped_tiny_model_matches_the_builder(tmp_path):
    built = write_tiny_model_dir(tmp_path / "tiny")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shipped, fresh = (
            json.loads((REPO / "recipes/tiny-arith" / name).read_text()),
            json.loads((built / name).read_text()),
        )
        shipped.pop("transformers_version", None)
        fresh.pop("transformers_version", None)
        assert shipped == fresh, name


def test_readme_file_tree_matches_the_repository():
    readme = (REPO / "README.md").read_text()
    tree = readme.split("## Files", 1)[1].split("```")[1]
    listed = {line.split()[0] for line in tree.strip().splitlines()}
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    untracked = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, text=True
    ).stdout.split()
    # sub-package __init__.py files hold only a docstring; the README leaves them out
    files = {f for f in tracked + untracked if not re.fullmatch(r".+/.+/__init__\.py", f) and f != ".gitignore"}
    assert listed == files, f"missing from README: {sorted(files - listed)}; stale: {sorted(listed - files)}"
