"""Output trouble in one line: existing outputs (one --overwrite rule), outputs of the wrong kind, unwritable
folders, a full disk in the middle of a write, SIGTERM, and stale temporaries of killed commands. Also the
prompt limits (max_prompt_length, the model's context) and the prompts a step takes (no duplicates)."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlx.formats.data import take_prompts
from rlx.formats.records import read_prompts
from rlx.utils import files, io
from tests.conftest import REPO, cli, cli_ok, read_jsonl, rollout_args, run_script, write_jsonl

QUICKSTART = REPO / "recipes" / "quickstart.toml"
SMOLLM2_PROMPTS = REPO / "recipes" / "data" / "arith_chat.jsonl"


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_every_command_refuses_to_replace_an_output_without_overwrite(tmp_path, tiny_ckpt, prompts_file):
    out = tmp_path / "r.jsonl"
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, out))
    first = out.read_bytes()
    again = cli(*rollout_args(tiny_ckpt, prompts_file, out, "--seed", "5"))
    assert again.exit_code == 1 and "--overwrite" in again.stderr and out.read_bytes() == first
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, out, "--seed", "5", "--overwrite"))
    assert out.read_bytes() != first
    scored = tmp_path / "s"
    score = ["score", "--rollouts", out, "--actor", tiny_ckpt, "--reward", "arith", "--out", scored]
    cli_ok(*score)
    again = cli(*score)
    assert again.exit_code == 1 and "scores.jsonl: already exists" in again.stderr
    cli_ok(*score, "--overwrite")
    for command in (
        ["train-step", "--checkpoint", tiny_ckpt, "--batch", scored / "batch.safetensors", "--out", tiny_ckpt],
        ["merge", "--checkpoint", tiny_ckpt, "--out", scored],  # (an --out holding the input: test_shard_merge.py)
        ["shard", "--model", tiny_ckpt, "--out", scored],
        ["eval", "--model", tiny_ckpt, "--prompts", prompts_file, "--out", scored, "--max-new-tokens", "2"],
    ):
        if command[0] == "eval":
            cli_ok(*command)
        result = cli(*command)
        assert result.exit_code == 1 and "already exists" in result.stderr and "--overwrite" in result.stderr


def test_outputs_of_the_wrong_kind_fail_before_any_work(tmp_path, tiny_ckpt, prompts_file):
    folder = tmp_path / "folder"
    folder.mkdir()
    result = cli(*rollout_args(tiny_ckpt, prompts_file, folder))
    assert result.exit_code == 1 and "is a folder" in result.stderr and "Traceback" not in result.stderr
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "r.jsonl"))
    result = cli("score", "--rollouts", tmp_path / "r.jsonl", "--actor", tiny_ckpt, "--out", a_file)
    assert result.exit_code == 1 and "is a file" in result.stderr
    result = cli("ppo", QUICKSTART, "--out", a_file)
    assert result.exit_code == 1 and "is a file" in result.stderr and a_file.read_text() == "x"
    below_a_file = a_file / "sub" / "r.jsonl"
    result = cli(*rollout_args(tiny_ckpt, prompts_file, below_a_file))
    assert result.exit_code == 1 and "is a file, not a folder" in result.stderr


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_no_one_can_create_files_in_is_named_before_any_work(tmp_path, tiny_ckpt, prompts_file):
    """/proc takes no new file, for root too (whose os.access says yes): refused before generating or training,
    in one line naming --out."""
    for command in (rollout_args(tiny_ckpt, prompts_file, "/proc/r.jsonl"),
                    ["merge", "--checkpoint", tiny_ckpt, "--out", "/proc/m"]):  # fmt: skip
        result = cli(*command)
        assert result.exit_code == 1 and "cannot write the output in /proc" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_output_folder_is_one_line(tmp_path, tiny_ckpt, prompts_file):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        for command in (
            rollout_args(tiny_ckpt, prompts_file, folder / "r.jsonl"),
            ["shard", "--model", tiny_ckpt, "--out", folder / "c"],
            ["merge", "--checkpoint", tiny_ckpt, "--out", folder / "m"],
            ["ppo", QUICKSTART, "--out", folder / "run"],
        ):
            result = cli(*command)
            assert result.exit_code == 1 and "permission denied" in result.stderr, (command, result)
    finally:
        folder.chmod(0o755)


@pytest.mark.parametrize("code, message", [(errno.ENOSPC, "no space left on device"), (errno.EACCES, "denied")])
def test_a_failing_write_is_one_line_and_leaves_nothing(tmp_path, tiny_ckpt, prompts_file, monkeypatch, code, message):
    """A full disk (or a folder made unwritable meanwhile) in the middle of writing rollouts.jsonl."""
    import rlx.utils.io as io

    real = io.dumps_line
    written = []

    def full_disk(record):
        written.append(record)
        if len(written) > 3:
            raise OSError(code, os.strerror(code), "rollouts.jsonl")
        return real(record)

    monkeypatch.setattr(io, "dumps_line", full_disk)
    out_dir = tmp_path / "out"
    result = cli(*rollout_args(tiny_ckpt, prompts_file, out_dir / "r.jsonl"))
    assert result.exit_code == 1 and message in result.stderr and "Traceback" not in result.stderr, result
    assert len(result.stderr.strip().splitlines()) == 1
    assert list(out_dir.iterdir()) == []  # neither the file nor its temporary


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path, tiny_ckpt, prompts_file):
    host = socket.gethostname().replace("-", "_")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    stale_file = out_dir / f".r.jsonl.rlx-{host}-{dead_pid}-abc123.tmp"
    stale_dir = out_dir / f".ckpt.rlx-{host}-{dead_pid}-x_9.tmp"
    live = out_dir / f".other.rlx-{host}-{os.getpid()}-abc.tmp"
    foreign = out_dir / f".x.rlx-otherhost-{dead_pid}-abc.tmp"
    user = out_dir / ".my-notes.tmp"
    stale_file.write_text("partial")
    stale_dir.mkdir()
    (stale_dir / "model.safetensors").write_text("partial")
    for path in (live, foreign, user):
        path.write_text("keep")
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, out_dir / "r.jsonl"))
    assert leftovers(out_dir) == sorted([live.name, foreign.name, user.name])


def test_sigterm_removes_the_output_temporary(tmp_path, tiny_ckpt, prompts_file, monkeypatch):
    """SIGTERM while a command writes: exit 143, one line, no temporary left behind (the signal is sent to this
    process from inside the write; the command's handler turns it into an exception)."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        pytest.skip("a SIGTERM handler is already installed in this process")
    real = io.dumps_line

    def dumps_then_sigterm(record):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(record)

    monkeypatch.setattr(io, "dumps_line", dumps_then_sigterm)
    out_dir = tmp_path / "out"
    result = cli(*rollout_args(tiny_ckpt, prompts_file, out_dir / "r.jsonl"))
    assert result.exit_code == 143 and "terminated by SIGTERM" in result.stderr, result.stderr[-2000:]
    assert list(out_dir.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone after the command


def test_prompt_limits_in_rollout_and_eval(tmp_path, tiny_ckpt):
    long = "1+" * 30 + "1"  # 61 characters: over the tiny model's 64 positions with 8 new tokens
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1", "ground_truth": "2"}, {"prompt": long}])
    base = ["rollout", "--model", tiny_ckpt, "--prompts", prompts, "--max-new-tokens", "8"]
    result = cli(*base, "--out", tmp_path / "r.jsonl")
    assert result.exit_code == 1 and "1 of 2 prompts are too long" in result.stderr
    assert "context of 64" in result.stderr and not (tmp_path / "r.jsonl").exists()
    result = cli_ok(*base, "--out", tmp_path / "r.jsonl", "--on-long-prompt", "filter")
    assert "left out 1 of 2 prompts" in result.stderr
    assert [r["prompt_id"] for r in read_jsonl(tmp_path / "r.jsonl")] == ["0"]
    result = cli(*base, "--out", tmp_path / "r2.jsonl", "--max-prompt-length", "2")
    assert (
        result.exit_code == 1
        and "2 of 2 prompts are too long" in result.stderr
        and "max_prompt_length 2" in (result.stderr)
    )
    evaluated = cli(
        "eval", "--model", tiny_ckpt, "--prompts", prompts, "--out", tmp_path / "e", "--max-new-tokens", "8"
    )
    assert evaluated.exit_code == 1 and "1 of 2 prompts are too long" in evaluated.stderr


def test_prompt_limits_in_ppo(tmp_path):
    long = {"prompt": "1+" * 30 + "1", "ground_truth": "31", "id": "long"}
    rows = [{"prompt": f"{i}+1", "ground_truth": str(i + 1)} for i in range(5)] + [long]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    args = ["--set", f"data.prompts='{prompts}'", "--set", "data.prompts_per_step=5", "--set", "steps=1"]
    refused = cli("ppo", QUICKSTART, "--out", tmp_path / "a", *args, "--set", "rollout.sampling.max_new_tokens=8")
    assert refused.exit_code == 1 and "prompt 'long'" in refused.stderr and not (tmp_path / "a").exists()
    ok = cli_ok("ppo", QUICKSTART, "--out", tmp_path / "b", *args, "--set", "rollout.on_long_prompt='filter'",
                "--set", "rollout.max_prompt_length=10")  # fmt: skip
    assert "left out 1 of 6 prompts" in ok.stderr
    assert "long/0" not in (tmp_path / "b" / "step_000001" / "rollouts.jsonl").read_text()


def test_a_step_never_takes_a_prompt_twice():
    """The smollm2 recipe's data (64 per step, shuffled): seed 5 put a prompt twice into one step before."""
    records = read_prompts(SMOLLM2_PROMPTS)
    n = len(records)
    for seed in (0, 5):
        for position in range(0, 5 * n, 64):
            ids = [r.id for r in take_prompts(records, position, 64, seed)]
            assert len(set(ids)) == 64, (seed, position)
    # each epoch still visits every prompt once
    for epoch in range(4):
        ids = [r.id for r in take_prompts(records, epoch * n, n, 5)]
        assert sorted(ids) == sorted(r.id for r in records)


def test_more_prompts_per_step_than_the_file_holds_is_an_error(tmp_path, tiny_ckpt, prompts_file):
    result = cli(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "r.jsonl")[:-2], "--num-prompts", "65")
    assert result.exit_code == 1 and "holds 64 prompts" in result.stderr
    sets = ["--set", "data.prompts_per_step=1001", "--set", "train.mini_batch_size=0"]  # 128 does not divide 1001 x 8
    result = cli("ppo", QUICKSTART, "--out", tmp_path / "run", *sets)
    assert result.exit_code == 1 and "data.prompts_per_step = 1001" in result.stderr


def test_temporary_names_carry_host_and_pid(tmp_path):
    with files.atomic_local_path(tmp_path / "x.jsonl") as tmp:
        owner = files._temp_owner(tmp.name)
        assert owner == (socket.gethostname().replace("-", "_"), os.getpid())
    assert files._temp_owner(".notes.tmp") is None and files._temp_owner("x.rlx-h-1-a.tmp") is None


def test_a_file_size_limit_is_one_line_for_every_tensor_writer(tmp_path, tiny_ckpt, prompts_file):
    """safetensors reports EFBIG as its own SafetensorError (not an OSError): merge, train-step, shard and score
    still end with one line and exit 1, and leave no output (nor a temporary) behind. The four commands run in one
    subprocess (the file-size limit holds for a whole process), see tests/stages/workers/file_size_limit.py."""
    rollouts = tmp_path / "r.jsonl"
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, rollouts))
    cli_ok("score", "--rollouts", rollouts, "--actor", tiny_ckpt, "--reward", "arith", "--out", tmp_path / "s")
    batch = tmp_path / "s" / "batch.safetensors"
    commands = {
        "merge": ["merge", "--checkpoint", tiny_ckpt],
        "train-step": ["train-step", "--checkpoint", tiny_ckpt, "--batch", batch],
        "shard": ["shard", "--model", tiny_ckpt],
        "score": ["score", "--rollouts", rollouts, "--actor", tiny_ckpt, "--reward", "arith"],
    }
    for name in commands:
        (tmp_path / f"limited-{name}").mkdir()
    argv = [[*map(str, args), "--out", str(tmp_path / f"limited-{name}" / "out")] for name, args in commands.items()]
    env = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    done = run_script(Path(__file__).parent / "workers" / "file_size_limit.py", env, "2048", json.dumps(argv))
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["command"] for r in results] == list(commands), done.stdout[-3000:]
    for name, result in zip(commands, results):
        assert result["code"] == 1, (name, result["stderr"][-3000:])
        lines = [line for line in result["stderr"].splitlines() if line.startswith(f"rlx {name}: error:")]
        assert len(lines) == 1 and "file too large" in lines[0] and "Traceback" not in result["stderr"], result
        left = [p for p in (tmp_path / f"limited-{name}").rglob("*") if not p.is_dir()]  # score's --out may stay
        assert left == [], (name, left)


def test_score_writes_both_outputs_or_neither(tmp_path, tiny_ckpt, prompts_file, monkeypatch):
    """scores.jsonl fails after batch.safetensors was written whole: neither appears, and an earlier pair stays."""
    rollouts = tmp_path / "r.jsonl"
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, rollouts))
    out = tmp_path / "s"
    score = ["score", "--rollouts", rollouts, "--actor", tiny_ckpt, "--reward", "arith", "--out", out]
    real = io.dumps_line

    def full_disk(record):
        if "reward" in record:  # a scores.jsonl line: the batch is already written
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "scores.jsonl")
        return real(record)

    monkeypatch.setattr(io, "dumps_line", full_disk)
    result = cli(*score)
    assert result.exit_code == 1 and "no space left on device" in result.stderr, result
    assert list(out.iterdir()) == []  # no batch.safetensors without its scores.jsonl, no temporaries
    monkeypatch.setattr(io, "dumps_line", real)
    cli_ok(*score)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["batch.safetensors", "scores.jsonl"]
    monkeypatch.setattr(io, "dumps_line", full_disk)
    result = cli(*score, "--overwrite", "--kl-coef", "0.5")
    assert result.exit_code == 1 and {p.name: p.read_bytes() for p in out.iterdir()} == before
