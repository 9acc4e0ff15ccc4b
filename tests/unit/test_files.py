"""Shipped files stay what their generators make, and docs/FILES.md lists the repository."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from rlx.models.tiny import write_tiny_model_dir
from rlx.tasks.arith import generate_arith
from tests.conftest import REPO, read_jsonl


def test_shipped_task_data_matches_the_generator():
    assert read_jsonl(REPO / "recipes/data/arith_quickstart.jsonl") == generate_arith(1000, seed=0, max_value=4)
    assert read_jsonl(REPO / "recipes/data/arith_chat.jsonl") == generate_arith(
        4000, seed=0, max_value=20, ops="+-", style="chat"
    )
    heldout = read_jsonl(REPO / "recipes/data/arith_chat_heldout.jsonl")
    train = read_jsonl(REPO / "recipes/data/arith_chat99.jsonl")  # recipes/smollm2_arith.toml's training set
    assert train == generate_arith(
        8000, seed=2, max_value=99, ops="+-", style="chat", id_prefix="arith99", exclude=heldout
    )
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in heldout}


def test_shipped_calculator_prompts_and_demonstrations_match_the_generator():
    from rlx.tasks.calculator import generate_calculator, generate_demonstrations

    prompts = read_jsonl(REPO / "recipes/data/calculator.jsonl")
    assert prompts == generate_calculator(1000, seed=0, digits=2)
    demos = read_jsonl(REPO / "recipes/data/calculator_demos.jsonl")
    questions = [p["prompt"] for p in prompts]
    assert demos == generate_demonstrations(1000, seed=1, digits=2, exclude=questions, tool_fraction=0.5, choice=True)
    assert not {p["prompt"] for p in prompts} & {d["messages"][0]["content"] for d in demos}  # apart from RL's

    chat = read_jsonl(REPO / "recipes/data/calculator_chat.jsonl")  # the GPU recipe's, with the call written as text
    chat_demos = read_jsonl(REPO / "recipes/data/calculator_chat_demos.jsonl")
    questions = [p["prompt"][-1]["content"] for p in chat]
    assert chat_demos == generate_demonstrations(1000, seed=1, digits=4, exclude=questions, style="chat")
    assert not set(questions) & {d["messages"][1]["content"] for d in chat_demos}


def test_shipped_heldout_set_matches_the_generator_and_is_held_out(tmp_path):
    train = read_jsonl(REPO / "recipes/data/arith_chat.jsonl")
    heldout = read_jsonl(REPO / "recipes/data/arith_chat_heldout.jsonl")
    assert heldout == generate_arith(
        500, seed=1, max_value=99, ops="+-", style="chat", id_prefix="arith-heldout", exclude=train
    )
    questions = [r["prompt"][0]["content"] for r in heldout]
    assert len(set(questions)) == 500 and not set(questions) & {r["prompt"][0]["content"] for r in train}
    template = re.compile(r"What is (\d+) ([+-]) (\d+)\? Reply with only the final number\.")
    for record, question in zip(heldout, questions):  # phrased as the recipe's prompts, operands up to 99
        a, op, b = template.fullmatch(question).groups()
        assert (
            int(a) <= 99
            and int(b) <= 99
            and record["ground_truth"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
        )
    assert sum(max(int(a), int(b)) > 20 for a, _, b in (template.fullmatch(q).groups() for q in questions)) > 400
    command = [
        "--style",
        "chat",
        "--ops",
        "+-",
        "--max-value",
        "99",
        "--num",
        "500",
        "--seed",
        "1",
        "--id-prefix",
        "arith-heldout",
    ]
    command += ["--exclude", str(REPO / "recipes/data/arith_chat.jsonl"), "--out", str(tmp_path / "h.jsonl")]
    subprocess.run([sys.executable, "-m", "rlx.tasks.arith", *command], check=True, cwd=REPO)
    assert (tmp_path / "h.jsonl").read_bytes() == (REPO / "recipes/data/arith_chat_heldout.jsonl").read_bytes()
    with pytest.raises(ValueError, match="cannot hold out"):
        generate_arith(4, max_value=1, exclude=generate_arith(1, max_value=0))  # 4 questions exist, 1 excluded


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


def test_the_file_list_is_generated_from_the_tree():
    """docs/FILES.md is what docs/files.py makes now: every tracked file listed, modules by their docstrings."""
    done = subprocess.run([sys.executable, "docs/files.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_readme_stays_the_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 300
    for link in re.findall(r"\]\(((?:docs|bench)/[^)#]+)\)", readme):
        assert (REPO / link).exists(), link
