"""`rlx ppo` under failure: inputs checked before the run folder is written, restartable failed starts, the run
lock, --overwrite, SIGTERM, broken rewards, random init from a trained checkpoint, [eval] during training."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlx.tasks.arith import generate_arith
from tests.conftest import REPO, cli, cli_ok, read_jsonl, write_jsonl
from tests.stages.test_ppo import assert_same_weights

QUICKSTART = REPO / "recipes" / "quickstart.toml"
TINY = ["--set", "data.prompts_per_step=4", "--set", "rollout.sampling.n=2", "--set", "steps=2"]


def ppo(out: Path, *args) -> object:
    return cli("ppo", QUICKSTART, "--out", out, *TINY, *args)


def failing_reward(folder: Path, fail_when: str = "True") -> str:
    """A reward function file that raises when `fail_when` holds (extra_info in scope); returns its spec."""
    path = folder / "reward_fn.py"
    path.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    if {fail_when}:\n"
        "        raise ValueError('grader is broken')\n"
        "    return 1.0\n"
    )
    return f"{path}:score"


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.path='/nonexistent/model'", "model not found"),
        ("data.prompts='/nonexistent/prompts.jsonl'", "no such file"),
        ("score.reward='no_such_reward'", "no_such_reward"),
        ("data.prompts_per_step=4096", "prompts per step"),  # x 2 samples: the recipe's mini-batch of 128 divides it
    ],
)
def test_a_bad_start_writes_nothing(tmp_path, override, message):
    out = tmp_path / "run"
    result = ppo(out, "--set", override)
    assert result.exit_code == 1 and message in result.stderr, result
    assert not out.exists()


def test_a_bad_prompt_line_then_a_good_start(tmp_path):
    """Every prompt line is read before the folder is touched; the fixed recipe then starts without --resume."""
    prompts = write_jsonl(tmp_path / "p.jsonl", generate_arith(20, seed=0, max_value=4))
    with prompts.open("a") as f:
        f.write('{"prompt": 3}\n')
    out = tmp_path / "run"
    bad = ppo(out, "--set", f"data.prompts='{prompts}'")
    assert bad.exit_code == 1 and "p.jsonl:21" in bad.stderr and not out.exists()
    write_jsonl(prompts, generate_arith(20, seed=0, max_value=4))
    cli_ok("ppo", QUICKSTART, "--out", out, *TINY, "--set", f"data.prompts='{prompts}'")


def test_a_start_that_completed_no_step_can_be_started_again(tmp_path):
    out = tmp_path / "run"
    spec = failing_reward(tmp_path)
    failed = ppo(out, "--set", f"score.reward='{spec}'")
    assert failed.exit_code == 1 and "grader is broken" in failed.stderr
    assert (out / "recipe.json").exists()  # the start got as far as step 1
    again = ppo(out)  # a different recipe, no --resume: nothing was completed, so this is a new start
    assert again.exit_code == 0, again
    assert "completed no step" in again.stderr
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert json.loads((out / "recipe.json").read_text())["score"]["reward"] == ["arith"]
    # a run with a completed step is protected: --resume or --overwrite
    refused = ppo(out, "--set", "seed=4")
    assert refused.exit_code == 1 and "--resume" in refused.stderr and "--overwrite" in refused.stderr
    replaced = ppo(out, "--set", "seed=4", "--overwrite")
    assert replaced.exit_code == 0 and "replacing" in replaced.stderr
    assert json.loads((out / "recipe.json").read_text())["seed"] == 4
    assert ppo(out, "--resume", "--overwrite").exit_code == 1


def test_steps_that_ran_without_a_checkpoint_are_not_thrown_away_unasked(tmp_path):
    """A run killed before its first checkpoint (here: its checkpoints removed) still completed steps: a new start
    without --resume or --overwrite is refused naming them; --resume says nothing can be continued and starts
    again. An interrupted run's last line says what --resume will do."""
    from rlx.commands.ppo import _resume_hint

    out = tmp_path / "run"
    cli_ok("ppo", QUICKSTART, "--out", out, *TINY)
    assert "continue with the same command plus --resume" in _resume_hint(out)
    shutil.rmtree(out / "checkpoints")
    assert "no checkpoint was written yet, so --resume starts the run again at step 1" in _resume_hint(out)
    refused = ppo(out, "--set", "seed=5")
    assert refused.exit_code == 1 and "completed 2 step(s) but wrote no checkpoint" in refused.stderr
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]  # untouched
    again = ppo(out, "--resume")
    assert again.exit_code == 0 and "completed 2 step(s) but wrote no checkpoint: nothing to continue" in again.stderr
    assert _resume_hint(tmp_path / "elsewhere") == ""


def test_a_second_run_on_a_locked_folder_names_the_holder(tmp_path):
    out = tmp_path / "run"
    script = Path(__file__).parent / "workers" / "hold_lock.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, script, str(out)], stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        busy = ppo(out, "--resume")
        assert busy.exit_code == 1, busy
        assert f"pid {holder.pid}" in busy.stderr and socket.gethostname() in busy.stderr
        assert not (out / "recipe.json").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder died: its lock file (naming a dead pid) is simply taken over
    assert str(holder.pid) in (out / ".rlx-lock").read_text()
    cli_ok("ppo", QUICKSTART, "--out", out, *TINY)
    assert (out / ".rlx-lock").read_text() == ""  # released at the end


def test_checkpoints_that_do_not_fit_the_disk_are_named_before_step_1_and_when_a_write_fails(tmp_path, monkeypatch):
    """No room for one checkpoint: refused before the models are built (the policy's size from its config);
    room for fewer than keep_checkpoints keeps at once: a warning naming the step that would fail; a full disk during
    a write: one line naming the checkpoint, and --resume then finishes the run."""
    import errno

    from rlx.ppo import loop, rundir

    sizes, built = [], []
    real_bytes, real_prepare, real_build = loop.checkpoint_bytes, loop.prepare_save, loop.build_run_models
    monkeypatch.setattr(loop, "checkpoint_bytes", lambda modules: sizes.append(real_bytes(modules)) or sizes[-1])
    monkeypatch.setattr(loop, "build_run_models", lambda *a, **k: built.append(1) or real_build(*a, **k))
    monkeypatch.setattr(rundir, "free_bytes", lambda path: 500)
    out = tmp_path / "run"
    refused = ppo(out)
    assert refused.exit_code == 1 and "a checkpoint of this run takes about" in refused.stderr, refused
    assert "500 B free" in refused.stderr and "(step 2) would fail" in refused.stderr
    assert not built and not (out / "metrics.jsonl").exists() and not list(out.glob("step_*"))
    # just over the config's count (2% under the built models'): the check on the built models refuses it
    monkeypatch.setattr(rundir, "free_bytes", lambda path: 900_000)
    refused = ppo(out, "--overwrite")
    assert refused.exit_code == 1 and built and sizes == [903_168] and "(step 2) would fail" in refused.stderr

    monkeypatch.setattr(rundir, "free_bytes", lambda path: int(1.5 * sizes[-1]))
    warned = ppo(out, "--set", "keep_checkpoints=2", "--set", "save_every=1")
    assert warned.exit_code == 0 and "warning" in warned.stderr and "step 2 would fail" in warned.stderr, warned

    def full_at_step_2(out_dir, *args, **kwargs):
        write = real_prepare(out_dir, *args, **kwargs)
        if out_dir.name != "step_000002":
            return write

        def fail():
            raise OSError(errno.ENOSPC, "No space left on device")

        return fail

    monkeypatch.setattr(loop, "prepare_save", full_at_step_2)
    monkeypatch.setattr(rundir, "free_bytes", lambda path: 10 * sizes[-1])
    failed = ppo(out, "--overwrite", "--set", "save_every=1")
    assert failed.exit_code == 1 and "Traceback" not in failed.stderr, failed
    assert "checkpoints/step_000002: the checkpoint was not written (no space left on device)" in failed.stderr
    assert "--resume" in failed.stderr and not (out / "checkpoints" / "step_000002").exists()
    monkeypatch.setattr(loop, "prepare_save", real_prepare)
    resumed = ppo(out, "--resume", "--set", "save_every=1")
    assert resumed.exit_code == 0 and "after step 1" in resumed.stderr, resumed
    assert (out / "checkpoints" / "step_000002").is_dir()


def test_random_init_from_a_trained_checkpoint_is_refused(tmp_path, tiny_ckpt):
    trained = tmp_path / "trained"
    shutil.copytree(tiny_ckpt, trained)
    meta = json.loads((trained / "rlx.json").read_text())
    (trained / "rlx.json").write_text(json.dumps({**meta, "step": 7}))
    out = tmp_path / "run"
    result = ppo(out, "--set", f"model.path='{trained}'")
    assert result.exit_code == 1 and "trained checkpoint (step 7)" in result.stderr and not out.exists()
    shard = cli("shard", "--model", trained, "--init", "random", "--out", tmp_path / "s")
    assert shard.exit_code == 1 and "trained checkpoint" in shard.stderr
    cli_ok(
        "ppo", QUICKSTART, "--out", out, *TINY, "--set", f"model.path='{trained}'", "--set", "model.init='pretrained'"
    )


def test_reward_errors_are_counted_and_stop_the_run(tmp_path):
    spec = failing_reward(tmp_path, "extra_info['sample_index'] == 0")  # half the samples (n = 2)
    zero = ["--set", f"score.reward='{spec}'", "--set", "score.on_reward_error='zero'"]
    stopped = ppo(tmp_path / "a", *zero)
    assert stopped.exit_code == 1 and "4 of 8 samples' reward functions failed" in stopped.stderr, stopped
    shown = ppo(tmp_path / "b", *zero, "--set", "score.max_reward_error_fraction=0.5")
    assert shown.exit_code == 0 and shown.stderr.count("REWARD ERRORS 4") == 2, shown


def test_eval_during_training_leaves_the_training_stream_alone(tmp_path):
    held_out = write_jsonl(tmp_path / "held_out.jsonl", generate_arith(6, seed=9, max_value=4, id_prefix="val"))
    steps = ["--set", "steps=3", "--set", "save_every=3"]
    plain = cli_ok("ppo", QUICKSTART, "--out", tmp_path / "plain", *TINY, *steps)
    table = f"prompts='{held_out}', every=2, before_training=true, sampling={{max_new_tokens=3}}, reward=['arith']"
    evals = [f"eval={{{table}}}"]
    with_eval = cli_ok("ppo", QUICKSTART, "--out", tmp_path / "eval", *TINY, *steps, "--set", *evals)
    assert "val pass@1" in with_eval.stderr and "val pass@1" not in plain.stderr
    a, b = tmp_path / "plain", tmp_path / "eval"
    assert_same_weights(a / "checkpoints" / "step_000003", b / "checkpoints" / "step_000003")
    for step in ("step_000001", "step_000002", "step_000003"):
        assert (a / step / "rollouts.jsonl").read_bytes() == (b / step / "rollouts.jsonl").read_bytes()
    lines = read_jsonl(b / "metrics.jsonl")
    assert [m["step"] for m in lines if "val/pass@1" in m] == [0, 2, 3]  # before training, every 2, the last
    assert all(m["val/num_prompts"] == 6 for m in lines if "val/pass@1" in m)
    assert [len(read_jsonl(b / f"step_{s:06d}" / "eval.jsonl")) for s in (0, 2, 3)] == [6, 6, 6]
    cli_ok("report", b)
    assert (b / "report" / "val.png").exists() and "val/pass@1" in (b / "report" / "summary.md").read_text()


@pytest.mark.slow
def test_sigterm_stops_after_a_checkpoint_and_resume_finishes(tmp_path):
    out = tmp_path / "run"
    args = [
        "--set",
        "steps=40",
        "--set",
        "save_every=100",
        "--set",
        "data.prompts_per_step=4",
        "--set",
        "rollout.sampling.n=2",
    ]
    command = [sys.executable, "-m", "rlx", "ppo", str(QUICKSTART), "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    assert "stopped by SIGTERM after step" in stderr and "--resume" in stderr
    step = max(m["step"] for m in read_jsonl(out / "metrics.jsonl"))
    assert step < 40 and (out / "checkpoints" / f"step_{step:06d}" / "rlx.json").exists()
    resumed = cli_ok("ppo", QUICKSTART, "--out", out, *args, "--resume")
    assert f"after step {step}" in resumed.stderr
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == list(range(1, 41))


@pytest.mark.parametrize(
    "existing, new, keep, most",
    [(0, 5, 2, 3), (0, 1, 2, 1), (2, 3, 2, 3), (0, 4, 0, 4), (3, 2, 1, 4), (1, 0, 2, 1), (0, 3, 1, 2)],
)
def test_checkpoints_on_disk_at_most(existing, new, keep, most):
    """Each new checkpoint is published before the oldest beyond `keep` go: keep + 1 at once, or all with keep 0."""
    from rlx.ppo.rundir import checkpoints_on_disk_at_most

    assert checkpoints_on_disk_at_most(existing, new, keep) == most
