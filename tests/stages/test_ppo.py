"""`rlx ppo`: artifacts, resume after a kill, equality with the shell pipeline, and the quickstart learns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlx.models.loading import read_weights
from rlx.observe.tracking import VOLATILE_PREFIXES
from rlx.ppo.config import load_recipe
from rlx.ppo.loop import run_ppo
from tests.conftest import REPO, cli, cli_env, cli_ok, read_jsonl, rollout_args

QUICKSTART = REPO / "recipes" / "quickstart.toml"
SMALL = ["--set", "data.prompts_per_step=8", "--set", "rollout.sampling.n=4", "--set", "save_every=1"]


def stable(metrics: list[dict]) -> dict[int, dict]:
    """Metrics merged per step, without the machine-dependent timing/throughput keys. The rollout-versus-trainer
    diagnostics (`rollout_corr/*`) measure float32 noise (~1e-7) that depends on the process's thread count, so
    they are compared to 5 decimals."""
    out: dict[int, dict] = {}
    for line in metrics:
        kept = {k: v for k, v in line.items() if not k.startswith(VOLATILE_PREFIXES)}
        out.setdefault(line["step"], {}).update(
            {k: round(v, 5) if k.startswith("rollout_corr/") else v for k, v in kept.items()}
        )
    return out


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = read_weights(a), read_weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def test_run_writes_the_artifacts_of_every_stage(tmp_path):
    run = tmp_path / "run"
    result = cli_ok("ppo", QUICKSTART, "--out", run, "--set", "steps=3", "--set", "keep_checkpoints=2", *SMALL)
    assert "step 3/3" in result.stderr
    for step in (1, 2, 3):
        names = {p.name for p in (run / f"step_{step:06d}").iterdir()}
        assert names == {"rollouts.jsonl", "scores.jsonl", "batch.safetensors"}
        assert len(read_jsonl(run / f"step_{step:06d}" / "rollouts.jsonl")) == 32
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    meta = json.loads((run / "checkpoints" / "step_000003" / "rlx.json").read_text())
    assert meta["step"] == 3 and meta["data_position"] == 24
    lines = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2, 3]
    for key in (
        "reward/mean",
        "reward/std",
        "response_length/mean",
        "actor/ref_kl",
        "actor/entropy",
        "actor/pg_clipfrac",
        "timing/rollout_s",
        "timing/score_s",
        "timing/actor_train_s",
    ):
        assert key in lines[-1], key
    assert json.loads((run / "recipe.json").read_text())["steps"] == 3
    # the run dir is not reused by accident, and finished runs say so on --resume
    again = cli("ppo", QUICKSTART, "--out", run, "--set", "steps=3", *SMALL)
    assert again.exit_code == 1 and "--resume" in again.stderr
    done = cli_ok(
        "ppo", QUICKSTART, "--out", run, "--set", "steps=3", "--set", "keep_checkpoints=2", *SMALL, "--resume"
    )
    assert "all 3 steps are done" in done.stderr
    other = cli("ppo", QUICKSTART, "--out", run, "--set", "steps=3", "--set", "train.optim.lr=0.1", *SMALL, "--resume")
    assert other.exit_code == 1 and "train.optim.lr" in other.stderr


def test_a_run_from_before_a_new_optional_table_resumes(tmp_path):
    """recipe.json of a run written before [sft] and [async] existed has no key for them: it still resumes (the
    tables are not used), and a real difference is still refused."""
    run = tmp_path / "run"
    cli_ok("ppo", QUICKSTART, "--out", run, "--set", "steps=1", *SMALL)
    saved = json.loads((run / "recipe.json").read_text())
    assert saved.pop("sft") is None and saved.pop("async_") is None
    (run / "recipe.json").write_text(json.dumps(saved))
    cli_ok("ppo", QUICKSTART, "--out", run, "--resume", "--set", "steps=2", *SMALL)
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    sets = ["--set", "steps=3", "--set", "train.optim.lr=0.5"]
    changed = cli("ppo", QUICKSTART, "--out", run, "--resume", *sets, *SMALL)
    assert changed.exit_code == 1 and "differs from the run's at 'train.optim.lr'" in changed.stderr, changed


def test_resume_after_kill_gives_the_same_weights(tmp_path):
    args = ["--set", "steps=10", "--set", "keep_checkpoints=0", *SMALL]
    reference = tmp_path / "reference"
    run_ppo(load_recipe(QUICKSTART, [a for a in args if a != "--set"]), reference)
    run = tmp_path / "killed"
    command = [sys.executable, "-m", "rlx", "ppo", str(QUICKSTART), "--out", str(run), *args]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while not (run / "checkpoints" / "step_000004").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "checkpoints" / "step_000010").exists(), "the run finished before it was killed"
    cli_ok("ppo", QUICKSTART, "--out", run, *args, "--resume")
    assert_same_weights(reference / "checkpoints" / "step_000010", run / "checkpoints" / "step_000010")
    assert stable(read_jsonl(reference / "metrics.jsonl")) == stable(read_jsonl(run / "metrics.jsonl"))
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == list(range(1, 11))


def test_shell_pipeline_equals_the_driver(tmp_path):
    """recipes/quickstart.sh, stage by stage, gives the metrics and weights of `rlx ppo` on the same recipe."""
    env = cli_env(STEPS="2", SEED="3")
    subprocess.run(
        ["bash", str(REPO / "recipes" / "quickstart.sh"), str(tmp_path / "sh")],
        env=env,
        check=True,
        capture_output=True,
    )
    cli_ok("ppo", QUICKSTART, "--out", tmp_path / "ppo", "--set", "steps=2", "--set", "seed=3")
    sh, ppo = tmp_path / "sh", tmp_path / "ppo"
    assert_same_weights(sh / "checkpoints" / "step_000002", ppo / "checkpoints" / "step_000002")
    assert stable(read_jsonl(sh / "metrics.jsonl")) == stable(read_jsonl(ppo / "metrics.jsonl"))
    for step in ("step_000001", "step_000002"):
        assert (sh / step / "rollouts.jsonl").read_bytes() == (ppo / step / "rollouts.jsonl").read_bytes()
        assert (sh / step / "scores.jsonl").read_bytes() == (ppo / step / "scores.jsonl").read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 3])  # two seeds: each run is ~25 s of CI time
def test_quickstart_learns_for_any_seed(tmp_path, seed):
    # 100 of the recipe's 150 steps: the reward's gain (steps 1-5 -> 96-100) was 0.61 / 0.62 (0.78 / 0.78 at 150)
    run = tmp_path / "run"
    run_ppo(load_recipe(QUICKSTART, [f"seed={seed}", "steps=100"]), run)
    rewards = [m["reward/mean"] for m in read_jsonl(run / "metrics.jsonl")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= first + 0.3, (seed, first, last)


def test_run_with_tracking_traces_and_mfu(tmp_path):
    run = tmp_path / "run"
    cli_ok(
        "ppo",
        QUICKSTART,
        "--out",
        run,
        "--set",
        "steps=2",
        "--set",
        'tracking.backends=["console", "tensorboard"]',
        "--set",
        "tracking.traces_per_step=3",
        *SMALL,
    )
    traces = read_jsonl(run / "traces.jsonl")
    assert [t["step"] for t in traces] == [1, 1, 1, 2, 2, 2]
    assert {"id", "prompt", "response", "reward", "advantage"} <= set(traces[0])
    assert any((run / "tensorboard").rglob("events.out.tfevents.*"))
    line = read_jsonl(run / "metrics.jsonl")[-1]
    keys = ("perf/mfu", "perf/mfu_train", "perf/flops", "memory/train_host_rss_gb", "timing/rollout_s", "timing/gc_s")
    for key in keys:
        assert isinstance(line[key], float), key
    assert 0 < line["perf/mfu"] < 1


def test_snapshot_buffers_are_pinned_ahead_only_for_the_layout_that_copies_them(monkeypatch):
    """The first checkpoint's host buffers are reserved for trainers whose state the default layout copies
    (`snapshot_state`); a backend with a layout of its own (megatron's stages) reserves nothing (the 'fsdp' layout's
    own buffers: tests/unit/test_fsdp_host_buffers.py)."""
    from types import SimpleNamespace

    from rlx.ppo import loop

    reserved, submitted = [], []
    monkeypatch.setattr(loop, "reserve", lambda shapes, tag: reserved.append(tag) or 0)
    trainer = SimpleNamespace(snapshot_layout=lambda: [({"w": ((2, 3), torch.float32)}, "actor/weights")])
    writer = SimpleNamespace(submit=lambda job: submitted.append(job) or job())
    trainer.state = lambda: None
    for layout in ("single", "megatron"):
        run = SimpleNamespace(_save_layout=lambda layout=layout: layout, trainer=trainer, critic=None, writer=writer)
        loop.PPORun._reserve_snapshot_buffers(run)
    assert len(submitted) == 1 and reserved == ["actor/weights"]


def test_a_kill_during_a_background_checkpoint_write_resumes_bit_exactly(tmp_path, monkeypatch):
    """Checkpoint files are written by a background thread while the next step runs; a kill -9 in the middle of
    step 4's write leaves no step_000004, and --resume from step 2's gives the uninterrupted run's weights and
    metrics. After a process's first step (no checkpoint at it) the writer thread pins the snapshot buffers of the
    first checkpoint ahead (on the CPU: nothing to pin)."""
    from rlx.ppo import loop

    reserved = []
    monkeypatch.setattr(loop, "reserve", lambda shapes, tag: reserved.append((tag, shapes)) or 0)
    args = [*SMALL, "--set", "steps=6", "--set", "save_every=2", "--set", "keep_checkpoints=0"]
    reference = tmp_path / "reference"
    cli_ok("ppo", QUICKSTART, "--out", reference, *args)
    assert reserved == [("actor/weights", {}), ("actor/optimizer", {})]
    run = tmp_path / "killed"
    script = Path(__file__).parent / "workers" / "kill_during_write.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(script), "ppo", str(QUICKSTART), "--out", str(run), *args], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000002"]
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")][-1] >= 4  # step 4's line came before its files
    cli_ok("ppo", QUICKSTART, "--out", run, *args, "--resume")
    assert not list((run / "checkpoints").glob(".step_*"))  # the killed write's temporary folder is gone
    assert_same_weights(reference / "checkpoints" / "step_000006", run / "checkpoints" / "step_000006")
    assert stable(read_jsonl(reference / "metrics.jsonl")) == stable(read_jsonl(run / "metrics.jsonl"))


def test_the_device_is_read_before_the_fast_path_fills_the_engine(monkeypatch):
    """On CUDA, `rollout.tp_degree = 2` with no engine named validates only after the fast path chose the native
    engine: `rlx ppo` must not build (and validate) the config before it knows the device."""
    from rlx.commands import ppo as command

    recipe, overrides = REPO / "recipes" / "quickstart.toml", ["rollout.tp_degree=2"]
    assert command._train_device(recipe, overrides) == "auto"
    assert command._train_device(recipe, [*overrides, "train.device=cpu"]) == "cpu"
    assert load_recipe(recipe, overrides, "cuda").rollout.engine == "native"
    with pytest.raises(Exception, match="tensor parallel rollout needs engine"):
        load_recipe(recipe, overrides, "cpu")


def test_a_long_phase_says_it_is_still_running(tmp_path, monkeypatch):
    """A phase that runs past the heartbeat's first wait prints '<step>: <phase>: still running (N s)' (a 14B step on
    one GPU was minutes of silence: model building, the first compile); short phases print nothing."""
    import rlx.observe.tracking as tracking

    monkeypatch.setattr(tracking, "HEARTBEAT_S", (0.2, 0.2))
    slow = tmp_path / "slow_reward.py"
    slow.write_text(
        "import time\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    time.sleep(0.05)\n    return 0.0\n"
    )  # 8 x 4 samples: ~1.6 s of scoring
    result = cli_ok("ppo", QUICKSTART, "--out", tmp_path / "run", "--set", "steps=1", "--set",
                    f"score.reward=['{slow}:score']", *SMALL)  # fmt: skip
    lines = [line for line in result.stderr.splitlines() if "still running" in line]
    assert all(line.startswith(("step 1/1: ", "rlx ppo: building the models: ")) for line in lines), lines
    assert any(line.startswith("step 1/1: score: still running (") for line in lines), lines  # the rewards


def test_a_long_stage_command_says_it_is_still_running(tmp_path, monkeypatch, tiny_ckpt, prompts_file):
    """`rlx score` (as rollout, train-step, eval, shard and merge) past the heartbeat's first wait says so."""
    import rlx.observe.tracking as tracking

    monkeypatch.setattr(tracking, "HEARTBEAT_S", (0.1, 0.1))
    slow = tmp_path / "slow_reward.py"
    slow.write_text("import time\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    time.sleep(0.05)\n    return 0.0\n")  # fmt: skip
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "r.jsonl"))
    result = cli_ok("score", "--rollouts", tmp_path / "r.jsonl", "--actor", tiny_ckpt, "--reward", f"{slow}:score",
                    "--out", tmp_path / "s")  # fmt: skip
    assert "rlx score: still running (" in result.stderr


def test_the_heartbeat_is_silent_for_a_short_block_and_without_a_label(capsys):
    from rlx.observe.tracking import heartbeat

    with heartbeat("quick", first_s=5.0):
        pass
    with heartbeat(None, first_s=0.01):
        time.sleep(0.05)
    with heartbeat("long", first_s=0.02, every_s=0.05):
        time.sleep(0.16)
    lines = capsys.readouterr().err.splitlines()
    # beats at ~0.02, 0.07, 0.12 s (more if the machine is slow to wake the sleeper): it repeats, and stops at the end
    assert len(lines) >= 2 and all(line.startswith("long: still running (") for line in lines), lines


def test_a_mini_batch_size_that_does_not_divide_a_step_is_refused_and_a_short_step_is_said_once(tmp_path):
    """~15 s: train.mini_batch_size must divide a step's prompts_per_step x n samples (refused before the run folder
    is written, naming the nearest sizes). Dynamic sampling that does not fill a step (data.max_gen_batches 1) trains
    fewer samples, which a size dividing a full step may not divide: here a reward informative for odd answers only
    keeps 3, 4, 4, 3 of 6 groups of 2 at steps 1-4, so steps 1 and 4 cut 6 samples into mini-batches of 4 and 2 (two
    updates). The warning says so once, naming the sizes."""
    reward = tmp_path / "odd.py"  # informative (the samples' scores differ) for prompts with an odd answer only
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(int(ground_truth) % 2 == 1 and extra_info['sample_index'] == 0)\n")  # fmt: skip
    recipe, run = REPO / "recipes" / "dapo_quickstart.toml", tmp_path / "run"
    sets = ["steps=4", "save_every=4", "data.prompts_per_step=6", "rollout.sampling.n=2", "data.max_gen_batches=1",
            f'score.reward="{reward}:score"', "train.micro_batch_size=8"]  # fmt: skip
    args = [a for s in sets for a in ("--set", s)]
    refused = cli("ppo", recipe, "--out", run, *args, "--set", "train.mini_batch_size=5")
    assert refused.exit_code == 1 and not run.exists()
    assert (
        "--set: train.mini_batch_size: 5 does not divide the 12 samples of a step (data.prompts_per_step 6 x "
        "rollout.sampling.n 2): 2 optimizer steps of 5 and one of 2 each epoch; nearest sizes that divide it: 4 or 6"
    ) in refused.stderr
    done = cli_ok("ppo", recipe, "--out", run, *args, "--set", "train.mini_batch_size=4")
    said = [line for line in done.stderr.splitlines() if "warning: step" in line]
    assert len(said) == 1 and said[0].startswith("rlx ppo: warning: step 1 trains 6 samples (dynamic sampling found 3")
    assert "train.mini_batch_size 4 cuts them into 1 optimizer step of 4 and one of 2" in said[0]
    metrics = {m["step"]: m for m in read_jsonl(run / "metrics.jsonl")}
    assert [metrics[s]["dynamic_sampling/kept_groups"] for s in (1, 2, 3, 4)] == [3, 4, 4, 3]
    assert [metrics[s]["actor/num_updates"] for s in (1, 2, 3, 4)] == [2, 2, 2, 2]
