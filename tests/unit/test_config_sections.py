"""Config sections with flat flags: recipe keys grouped into tables ([train.optim], [train.loss], [train.correction],
[sft.optim]), the old flat keys still read with one notice naming the new key, the nested tree round-tripping, and
every moved field still set by its flat CLI flag (--lr, --clip-ratio-high, --rollout-is)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import typer

from rlx.cli import app
from rlx.commands._options import build_from_options, field_options
from rlx.config import ConfigError, from_dict, move_keys, to_dict
from rlx.errors import UserError
from rlx.evaluation.evaluate import EvalConfig
from rlx.ppo.config import MOVED_KEYS, PPOConfig, load_recipe
from rlx.ppo.rundir import _add_unused_new_tables
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.sft.config import SFTConfig
from rlx.training.config import TrainConfig
from tests.conftest import REPO

BASE = '[model]\npath = "m"\n[data]\nprompts = "p.jsonl"\n'

OLD = (
    BASE
    + """
[train]
lr = 3e-4
clip_ratio_high = 0.28
rollout_is = "token"
mini_batch_size = 4

[critic]

[critic.train]
lr = 2e-4
cliprange_value = 0.3

[sft]
data = "d.jsonl"
lr = 5e-5
"""
)

NEW = (
    BASE
    + """
[train]
mini_batch_size = 4

[train.optim]
lr = 3e-4

[train.loss]
clip_ratio_high = 0.28

[train.correction]
rollout_is = "token"

[critic]

[critic.train.optim]
lr = 2e-4

[critic.train.loss]
cliprange_value = 0.3

[sft]
data = "d.jsonl"

[sft.optim]
lr = 5e-5
"""
)


def test_old_flat_keys_give_one_notice_each_and_the_same_config(tmp_path, capsys):
    old, new = tmp_path / "old.toml", tmp_path / "new.toml"
    old.write_text(OLD)
    new.write_text(NEW)
    from_new = load_recipe(new)
    assert capsys.readouterr().err == ""
    from_old = load_recipe(old)
    notices = capsys.readouterr().err.splitlines()
    assert f"{old}: [train] lr is now [train.optim] lr; the old key works until the next release" in notices
    assert any("[critic.train] cliprange_value is now [critic.train.loss] cliprange_value" in n for n in notices)
    assert any("[sft] lr is now [sft.optim] lr" in n for n in notices)
    assert len(notices) == 6, notices  # one line per old key
    assert dataclasses.replace(from_old, sft=dataclasses.replace(from_old.sft, data=from_new.sft.data)) == from_new
    assert from_new.train.optim.lr == 3e-4 and from_new.train.loss.clip_ratio_high == 0.28
    assert from_new.train.correction.rollout_is == "token" and from_new.critic.train.loss.cliprange_value == 0.3
    assert from_new.sft.optim.lr == 5e-5 and from_new.critic.train.role == "critic"


def test_old_keys_in_set_overrides_move_too_and_both_ways_at_once_is_an_error(tmp_path, capsys):
    recipe = tmp_path / "r.toml"
    recipe.write_text(NEW)
    cfg = load_recipe(recipe, ["train.lr=0.5", "train.entropy_coef=0.01"])
    assert cfg.train.optim.lr == 0.5 and cfg.train.loss.entropy_coef == 0.01
    err = capsys.readouterr().err
    assert "--set train.lr is now --set train.optim.lr" in err and "train.loss.entropy_coef" in err
    cfg = load_recipe(recipe, ["critic.train={lr=0.25, cliprange_value=0.4}"])  # old keys inside a whole table
    assert cfg.critic.train.optim.lr == 0.25 and cfg.critic.train.loss.cliprange_value == 0.4
    assert "--set: critic.train.lr is now critic.train.optim.lr" in capsys.readouterr().err
    recipe.write_text(NEW.replace("[train]\n", "[train]\nlr = 0.1\n"))
    with pytest.raises(UserError, match=r"train\.lr: give train\.optim\.lr only"):
        load_recipe(recipe)


def test_a_partial_table_keeps_its_owner_s_defaults(tmp_path):
    """[sft.optim] without lr keeps SFT's 1e-5 (not OptimConfig's 1e-6); the CLI's --lr default is the same."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(BASE + '[sft]\ndata = "d.jsonl"\n[sft.optim]\nwarmup_steps = 2\n')
    sft = load_recipe(recipe).sft
    assert (sft.optim.lr, sft.optim.warmup_steps) == (1e-5, 2) and SFTConfig().optim.lr == 1e-5
    assert TrainConfig().optim.lr == 1e-6
    (lr,) = [p for p in field_options(SFTConfig) if p.name == "lr"]
    assert lr.default == 1e-5


def test_the_nested_tree_round_trips(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(NEW)
    cfg = load_recipe(recipe)
    tree = json.loads(json.dumps(to_dict(cfg)))
    assert tree["train"]["optim"]["lr"] == 3e-4 and "lr" not in tree["train"]
    assert tree["train"]["loss"]["clip_ratio_high"] == 0.28 and tree["sft"]["optim"]["lr"] == 5e-5
    assert from_dict(PPOConfig, tree) == cfg
    for shipped in sorted((REPO / "recipes").glob("*.toml")):  # the shipped recipes use the new keys only
        text = shipped.read_text()
        assert not [old for old in MOVED_KEYS if _holds(text, old)], shipped


def _holds(text: str, dotted: str) -> bool:
    """Whether TOML `text` sets the key `dotted` under its own table header (`[train]` then `lr = ...`)."""
    table, _, name = dotted.rpartition(".")
    section = None
    for line in text.splitlines():
        if line.startswith("["):
            section = line.split("]")[0].strip("[ ")
        elif section == table and line.split("=")[0].strip() == name:
            return True
    return False


def _flags(command: str) -> set[str]:
    click = typer.main.get_command(app).commands[command]
    return {opt for p in click.params for opt in p.opts}


def _moved_fields(table: str) -> dict[str, str]:
    """{field name: its section} of the keys MOVED_KEYS moves out of `table`."""
    out = {}
    for old, new in MOVED_KEYS.items():
        if old.rpartition(".")[0] == table:
            out[old.rpartition(".")[2]] = new[len(table) + 1 :].split(".")[0]
    return out


def _nondefault(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1 if not isinstance(value, float) else value / 2 + 0.01
    return value


FLAT_CASES = [
    ("train-step", TrainConfig, "train", {}),
    ("sft", SFTConfig, "sft", {}),
    ("rollout", RolloutConfig, "rollout", {}),
    ("eval", EvalConfig, "eval", {"prompts": "p.jsonl", "temperature": 0.5}),  # n > 1 needs a temperature
]


@pytest.mark.parametrize(("command", "cls", "table", "base"), FLAT_CASES)
def test_every_moved_field_is_set_by_its_flat_flag(command, cls, table, base):
    """Each key MOVED_KEYS moves out of a table is still its command's flag of the same name, and the value given
    to the flag lands in the field's new section (through the commands' own option builder)."""
    flags = _flags(command)
    moved = _moved_fields(table)
    assert moved
    defaults = {p.name: p.default for p in field_options(cls)}
    for name, section in moved.items():
        assert f"--{name.replace('_', '-')}" in flags, name
        value, expected = _legal_value(cls, section, name, base)
        cfg = build_from_options(cls, {**defaults, **base, name: value})
        assert getattr(getattr(cfg, section), name) == expected, name


def _legal_value(cls, section: str, name: str, base: dict):
    """(a flag value other than the default that the section accepts, the field's value it gives)."""
    special = {
        "lr_schedule": "linear",
        "lr_decay_steps": 10,
        "policy_loss": "gspo",
        "loss_agg_mode": "seq-mean-token-sum",
        "kl_loss_type": "k1",
        "rollout_is": "token",
        "rollout_rs": "geometric",
        "betas": [0.8, 0.9],
        "clip_ratio_c": 4.0,
        "min_lr_ratio": 0.5,
        "top_p": 0.5,
        "env": "envs.py:Env",
        "agent": "agents.py:run",
        "on_env_error": "zero",
        "tool_parser": "hermes",
        "paged_attention": "torch",
        "lora_rollout": "adapters",
    }
    if name == "stop":
        return ["</s>", "\n\n"], ("</s>", "\n\n")
    if name == "chat_template_kwargs":
        return '{"enable_thinking": false}', {"enable_thinking": False}
    if name in special:
        return special[name], special[name]
    value = _nondefault(getattr(getattr(cls(**{k: v for k, v in base.items() if k == "prompts"}), section), name))
    return value, value


def test_section_errors_name_the_flag_and_the_recipe_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^clip_ratio_low"):
        build_from_options(
            TrainConfig, {**{p.name: p.default for p in field_options(TrainConfig)}, "clip_ratio_low": 2.0}
        )
    recipe = tmp_path / "r.toml"
    recipe.write_text(BASE + "[train.loss]\nclip_ratio_low = 2.0\n")
    with pytest.raises(UserError, match=r"train\.loss\.clip_ratio_low: must be in \[0, 1\)"):
        load_recipe(recipe)


OLD_ROLLOUT = (
    BASE
    + """
[rollout]
engine = "native"
n = 4
temperature = 0.7
stop = ["</s>"]
max_num_seqs = 32
max_model_len = 512
agent = "agents.py:run"
max_turns = 3

[eval]
prompts = "held_out.jsonl"
n = 2
temperature = 0.5
"""
)

NEW_ROLLOUT = (
    BASE
    + """
[rollout]
engine = "native"

[rollout.sampling]
n = 4
temperature = 0.7
stop = ["</s>"]

[rollout.native]
max_num_seqs = 32

[rollout.vllm]
max_model_len = 512

[rollout.agent]
agent = "agents.py:run"
max_turns = 3

[eval]
prompts = "held_out.jsonl"

[eval.sampling]
n = 2
temperature = 0.5
"""
)


def test_old_rollout_and_eval_keys_give_the_same_config(tmp_path, capsys):
    """[rollout]'s sampling, engine and agent keys and [eval]'s sampling keys move to their tables; `agent` (a string
    then, a table now) moves into [rollout.agent]."""
    old, new = tmp_path / "old.toml", tmp_path / "new.toml"
    old.write_text(OLD_ROLLOUT)
    new.write_text(NEW_ROLLOUT)
    from_new = load_recipe(new)
    assert capsys.readouterr().err == ""
    assert load_recipe(old) == from_new
    err = capsys.readouterr().err
    assert "[rollout] agent is now [rollout.agent] agent" in err and "[eval] n is now [eval.sampling] n" in err
    assert "[rollout] max_num_seqs is now [rollout.native] max_num_seqs" in err and len(err.splitlines()) == 9
    rollout = from_new.rollout
    assert rollout.sampling == SamplingParams(n=4, temperature=0.7, stop=("</s>",))
    assert (rollout.native.max_num_seqs, rollout.vllm.max_model_len) == (32, 512)
    assert rollout.agent.agent == "agents.py:run" and rollout.agent.is_multi_turn
    assert from_new.eval.sampling == SamplingParams(n=2, temperature=0.5)
    greedy = tmp_path / "greedy.toml"  # [eval.sampling] keeps eval's greedy default for what it leaves out
    greedy.write_text(BASE + '[eval]\nprompts = "h.jsonl"\n[eval.sampling]\nmax_new_tokens = 9\n')
    assert load_recipe(greedy).eval.sampling == SamplingParams(temperature=0.0, max_new_tokens=9)


def test_eval_help_lists_the_derived_options():
    """`rlx eval` builds its options from EvalConfig (its sampling table flat) and the engine's RolloutConfig fields:
    each one's help is the field's docstring and shows eval's own default (greedy)."""
    from tests.conftest import cli_ok

    text = " ".join(cli_ok("eval", "--help").stdout.split())
    for flag in ("--prompts", "--reward", "--n", "--num-samples", "--temperature", "--top-p", "--top-k",
                 "--max-new-tokens", "--stop", "--seed", "--correct-threshold", "--on-reward-error", "--engine",
                 "--batch-size", "--chat-template", "--device", "--precision", "--max-prompt-length",
                 "--on-long-prompt", "--model", "--out", "--metrics", "--overwrite"):  # fmt: skip
        assert flag in text, flag
    assert "--remax-baseline" not in text and "--every" not in text and "--env" not in text
    assert "Sampling temperature; 0 means greedy decoding. [default: 0.0]" in text
    assert "pass@k and mean@n need n > 1 and a temperature > 0" in text
    options = {p.name: p.default for p in field_options(EvalConfig)}
    assert options["temperature"] == 0.0 and options["n"] == 1


def test_an_old_run_folder_s_recipe_json_reads_as_the_new_tree():
    """A run started before the sections saved a flat recipe.json; moved the same way it equals the new tree, so
    `rlx ppo --resume` compares like with like (rlx/ppo/rundir.py)."""
    cfg = load_recipe(REPO / "recipes" / "quickstart_gae.toml")
    new = json.loads(json.dumps(to_dict(cfg)))
    old = copy.deepcopy(new)
    last = sorted(MOVED_KEYS, key=lambda k: MOVED_KEYS[k].startswith(k + "."))  # `agent` (the table's name) last
    for old_key in last:  # the flat layout: each field back in its old table
        new_key = MOVED_KEYS[old_key]
        *path, name = new_key.split(".")
        node = old
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or name not in node:
            continue  # a table the recipe leaves out (no [sft], [eval])
        value = node.pop(name)
        *old_path, old_name = old_key.split(".")
        target = old
        for part in old_path:
            target = target[part]
        target[old_name] = value
    for table in ("train", "critic"):
        assert "lr" in (old[table] if table == "train" else old[table]["train"])
    assert old != new and ("rollout.agent", "rollout.agent.agent") in move_keys(old, MOVED_KEYS)
    # a table born in a section (rollout.agent.verifiers) was never in the flat layout; unused, it reads as None there,
    # as rundir.py fills it on resume
    _add_unused_new_tables(old, new)
    assert old == new
