"""Asynchronous `rlx ppo` ([async]): rollout ranks and trainers under torchrun (gloo on CPU), the staleness bound
read back from the written records, max_staleness 0 == the synchronous loop, resume after a kill, learning, a
stalled rollout rank, and the errors of bad settings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlx.errors import UserError
from rlx.evaluation.evaluate import EVAL_FILE
from rlx.parallel.roles import check_split
from tests.conftest import REPO, WORKERS, cli, cli_ok, max_diff, read_jsonl, run_torchrun
from tests.stages.test_ppo import assert_same_weights

RECIPE = f"""
seed = 0
steps = 4
save_every = 1
keep_checkpoints = 0
[model]
path = "{REPO / "recipes" / "tiny-arith"}"
init = "random"
[data]
prompts = "{REPO / "recipes" / "data" / "arith_quickstart.jsonl"}"
prompts_per_step = 8
[rollout.sampling]
n = 4
max_new_tokens = 3
[score]
reward = "arith"
[train]
mini_batch_size = 128
[train.optim]
lr = 1e-3
"""


def write_recipe(tmp_path: Path, async_table: str | None = "max_staleness = 1") -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(RECIPE + (f"[async]\n{async_table}\n" if async_table is not None else ""))
    return path


def ppo_torchrun(n: int, recipe: Path, out: Path, *sets: str, **kwargs) -> subprocess.CompletedProcess:
    args = []  # KEY=VALUE settings, and options such as --resume as they are
    for s in sets:
        args += [s] if s.startswith("--") else ["--set", s]
    return run_torchrun(n, "-m", "rlx", "ppo", recipe, "--out", out, *args, **kwargs)


def ppo_one_process(recipe: Path, out: Path, *sets: str) -> None:
    """`rlx ppo` without torchrun, in this process (the synchronous run the async ones are compared with: the
    same numbers as one launched rank, without two interpreter start-ups)."""
    cli_ok("ppo", recipe, "--out", out, *[a for s in sets for a in ([s] if s.startswith("--") else ["--set", s])])


def check_staleness(run: Path, steps: int, bound: int) -> list[int]:
    """Every trained sample of every step within the bound (from rollouts.jsonl); the staleness per step."""
    worst = []
    for step in range(1, steps + 1):
        records = read_jsonl(run / f"step_{step:06d}" / "rollouts.jsonl")
        lags = [step - 1 - r["policy_version"] for r in records]
        assert all(0 <= lag <= bound for lag in lags), (step, lags)
        worst.append(max(lags))
        for r in records:  # 'continue': the runs of tokens under each policy, oldest first, none newer than step - 1
            runs = r.get("policy_versions") or [[0, r["policy_version"]]]
            assert runs[0] == [0, r["policy_version"]], r
            assert all(a[0] < b[0] < len(r["response_ids"]) and a[1] < b[1] <= step - 1 for a, b in zip(runs, runs[1:]))
    return worst


def test_bad_async_settings_are_one_line_errors(tmp_path):
    recipe = write_recipe(tmp_path)
    alone = cli("ppo", recipe, "--out", tmp_path / "run")
    assert alone.exit_code == 1 and "torchrun --nproc_per_node 2" in alone.stderr, alone
    assert not (tmp_path / "run").exists()
    for setting, words in (
        ("async.max_staleness=-1", "async.max_staleness: must be >= 0"),
        ("async.rollout_ranks=0", "async.rollout_ranks: must be at least 1"),
        ('async.partial_rollouts="later"', "async.partial_rollouts"),
    ):
        result = cli("ppo", recipe, "--out", tmp_path / "run", "--set", setting)
        assert result.exit_code == 1 and words in result.stderr, (setting, result)
    sets = ["--set", "score.filter_groups=true", "--set", 'score.reward_model="rm"']  # rollout ranks hold no RM
    result = cli("ppo", recipe, "--out", tmp_path / "run", *sets)
    assert result.exit_code == 1 and "score.filter_groups with score.reward_model is not supported" in result.stderr
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match="leaves no trainer among the 2 launched"):
        check_split(2, 1, (0, 2, 0))
    with pytest.raises(UserError, match="sequence-parallel groups of train.sp_degree = 2"):
        check_split(1, 2, (0, 4, 0))
    assert check_split(1, 2, (3, 3, 3)) == (3, 3, 3)


@pytest.mark.slow
def test_staleness_bound_and_resume_after_a_kill(tmp_path):
    """2 rollout ranks (the native engine: samples in flight go on under new weights) + 1 trainer at
    max_staleness 1, killed after step 3 and resumed: every step trains its own prompts' samples exactly once,
    each within the bound, and the regenerated ones say so."""
    recipe = write_recipe(tmp_path, "max_staleness = 1\nrollout_ranks = 2")
    sets = ["steps=8", "rollout.sampling.max_new_tokens=48", 'rollout.engine="native"']
    run = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "--rdzv-endpoint=localhost:0"]
    command += ["--rdzv-backend=c10d"]
    command += ["-m", "rlx", "ppo", str(recipe), "--out", str(run), *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(command, env=env, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 300
    while not (run / "checkpoints" / "step_000003").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "checkpoints" / "step_000008").exists(), "the run finished before it was killed"
    resumed_at = max(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))
    ppo_torchrun(3, recipe, run, *sets, "--resume")
    check_staleness(run, 8, 1)
    prompts = [json.loads(line)["id"] for line in (REPO / "recipes/data/arith_quickstart.jsonl").open()]
    for step in range(1, 9):
        records = read_jsonl(run / f"step_{step:06d}" / "rollouts.jsonl")
        expected = [f"{p}/{i}" for p in prompts[(step - 1) * 8 : step * 8] for i in range(4)]
        assert [r["id"] for r in records] == expected, step
        regenerated = {r.get("resumed_from") for r in records}
        assert regenerated == ({resumed_at} if resumed_at < step <= resumed_at + 2 else {None}), step
        assert all(r["rollout_restarts"] >= 0 for r in records)
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == list(range(1, 9))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["drop", "continue"])
def test_partial_rollouts_on_the_native_engine(tmp_path, mode):
    """1 rollout rank (native engine, one stream across steps) + 1 trainer at max_staleness 2, samples long enough
    that updates land while they are generated: every step trains its own prompts' samples, within the bound;
    'drop' records restarts and no mixed-policy samples, 'continue' never restarts and records where each
    policy's tokens begin."""
    run = tmp_path / "run"
    sets = [
        "steps=5",
        "rollout.sampling.max_new_tokens=48",
        'rollout.engine="native"',
        f'async.partial_rollouts="{mode}"',
    ]
    ppo_torchrun(2, write_recipe(tmp_path, "max_staleness = 2"), run, *sets)
    check_staleness(run, 5, 2)
    prompts = [json.loads(line)["id"] for line in (REPO / "recipes/data/arith_quickstart.jsonl").open()]
    records = []
    for step in range(1, 6):
        ours = read_jsonl(run / f"step_{step:06d}" / "rollouts.jsonl")
        assert [r["id"] for r in ours] == [f"{p}/{i}" for p in prompts[(step - 1) * 8 : step * 8] for i in range(4)]
        records += ours
    if mode == "drop":
        assert not any("policy_versions" in r for r in records)
    else:
        assert all(r["rollout_restarts"] == 0 for r in records)


EVAL_TABLE = f"""
[eval]
prompts = "{REPO / "recipes" / "data" / "arith_quickstart.jsonl"}"
every = 2
before_training = true
reward = ["arith"]
[eval.sampling]
max_new_tokens = 3
"""


def assert_same_as_the_synchronous_run(sync: Path, run: Path) -> None:
    """1 rollout rank + 1 trainer at max_staleness 0 (`run`) == `rlx ppo` in one process (`sync`), 4 steps: the same
    weights, metrics and samples."""
    assert_same_weights(sync / "checkpoints" / "step_000004", run / "checkpoints" / "step_000004")
    assert check_staleness(run, 4, 0) == [0, 0, 0, 0]
    steps = [[m for m in read_jsonl(r / "metrics.jsonl") if "actor/pg_loss" in m] for r in (sync, run)]
    assert [m["step"] for m in steps[0]] == [m["step"] for m in steps[1]] == [1, 2, 3, 4]
    for a, b in zip(*steps):
        for key in ("reward/mean", "actor/pg_loss", "actor/ref_kl", "actor/entropy"):
            assert a[key] == b[key], key
    for step in ("step_000001", "step_000004"):
        ours = read_jsonl(run / step / "rollouts.jsonl")
        assert [{k: v for k, v in r.items() if k not in ("policy_version", "rollout_restarts")} for r in ours] == (
            read_jsonl(sync / step / "rollouts.jsonl")
        )


@pytest.mark.slow
def test_eval_on_the_rollout_ranks(tmp_path):
    """[eval] in an async run: the rollout rank evaluates exactly the weights after each due step. At max_staleness
    0 the run is the synchronous one (weights, metrics, samples: the check of a plain max_staleness 0 run, here with
    the eval's samples next to the training ones) and its val/* metrics and eval.jsonl equal the synchronous run's;
    at 1 on the native engine (a stream across steps, the eval's samples in it next to training samples) each step's
    eval.jsonl equals `rlx eval` of that step's checkpoint."""
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE + EVAL_TABLE)
    (tmp_path / "sync").mkdir()
    ppo_one_process(recipe, tmp_path / "sync" / "run")
    ppo_torchrun(2, recipe, tmp_path / "lag0", "async.max_staleness=0")
    sync, lag0 = tmp_path / "sync" / "run", tmp_path / "lag0"
    assert_same_as_the_synchronous_run(sync, lag0)
    lines = [read_jsonl(run / "metrics.jsonl") for run in (sync, lag0)]
    val = [[{k: v for k, v in m.items() if k.startswith("val/")} for m in ms] for ms in lines]
    assert [m["step"] for m in lines[1] if "val/pass@1" in m] == [0, 2, 4]
    assert val[0] == val[1]
    for step in (0, 2, 4):
        assert read_jsonl(sync / f"step_{step:06d}" / EVAL_FILE) == read_jsonl(lag0 / f"step_{step:06d}" / EVAL_FILE)
    overlap = {m["step"]: m["async/eval_overlap_samples"] for m in lines[1] if "val/pass@1" in m}
    assert overlap[0] == overlap[2] == 8 * 4 and overlap[4] == 0  # the next step's samples ran next to the eval's
    run = tmp_path / "lag1"
    ppo_torchrun(
        2, recipe, run, "async.max_staleness=1", 'rollout.engine="native"', "rollout.sampling.max_new_tokens=24"
    )
    check_staleness(run, 4, 1)
    evaluated = [m for m in read_jsonl(run / "metrics.jsonl") if "val/pass@1" in m]
    assert [m["async/eval_overlap_samples"] for m in evaluated][:2] == [2 * 8 * 4, 8 * 4]
    assert all(m["async/eval_pending_s"] > 0 for m in evaluated)
    for step in (2, 4):
        out = tmp_path / f"eval{step}"
        cli_ok("eval", "--model", run / "checkpoints" / f"step_{step:06d}", "--prompts", REPO / "recipes" / "data" /
               "arith_quickstart.jsonl", "--reward", "arith", "--max-new-tokens", "3", "--engine", "native",
               "--out", out)  # fmt: skip
        ours = read_jsonl(run / f"step_{step:06d}" / EVAL_FILE)
        assert [s["response"] for s in ours] == [s["response"] for s in read_jsonl(out / EVAL_FILE)], step


MULTI_TURN = f"""
seed = 0
steps = 3
save_every = 1
keep_checkpoints = 0
[model]
path = "{REPO / "recipes" / "tiny-chat"}"
init = "random"
[data]
prompts = "{REPO / "recipes" / "data" / "calculator.jsonl"}"
prompts_per_step = 4
[rollout.agent]
env = "rlx.tasks.calculator:CalculatorEnv"
max_turns = 2
max_total_tokens = 320
[rollout.sampling]
n = 2
max_new_tokens = 8
[score]
reward = "env"
[train]
mini_batch_size = 128
[train.optim]
lr = 1e-3
"""


@pytest.mark.slow
def test_multi_turn_episodes_asynchronously(tmp_path):
    """[async] with an environment: at max_staleness 0 the same weights, episodes (token ids, loss masks, messages)
    and metrics as the synchronous multi-turn run; at max_staleness 1 every episode is one policy's, within the
    bound, and the turn metrics reach the metrics line."""
    assert_multi_turn_async_equals_sync(
        tmp_path, ("reward/mean", "actor/pg_loss", "rollout/turns_mean", "env/reward_mean")
    )
    ppo_torchrun(2, tmp_path / "recipe.toml", tmp_path / "lag1", "async.max_staleness=1", "steps=4")
    assert max(check_staleness(tmp_path / "lag1", 4, 1)) == 1
    assert all("rollout/turns_mean" in m for m in read_jsonl(tmp_path / "lag1" / "metrics.jsonl"))


@pytest.mark.slow
def test_megatron_trainers(tmp_path):
    """1 rollout rank + 2 megatron trainers (tp 2) at max_staleness 0: the merged weights of the one-process
    synchronous run (2% of lr, as the megatron tests compare), and the same rewards."""
    sets = [
        "steps=3",
        "data.prompts_per_step=4",
        "rollout.sampling.n=4",
        "train.mini_batch_size=8",
        "train.use_packing=true",
    ]
    args = [a for s in sets for a in ("--set", s)]
    cli_ok("ppo", REPO / "recipes" / "quickstart.toml", "--out", tmp_path / "one", *args)
    ppo_torchrun(3, REPO / "recipes" / "quickstart.toml", tmp_path / "async", *sets, "megatron.tp_degree=2",
                 "async.max_staleness=0")  # fmt: skip
    final = tmp_path / "async" / "checkpoints" / "step_000003"
    assert json.loads((final / "rlx.json").read_text())["layout"] == "megatron"
    cli_ok("merge", "--checkpoint", final, "--out", tmp_path / "merged")
    assert max_diff(tmp_path / "one" / "checkpoints" / "step_000003", tmp_path / "merged") < 2e-5  # lr 1e-3
    one, two = (read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("one", "async"))
    assert [m["reward/mean"] for m in one] == [m["reward/mean"] for m in two]


@pytest.mark.slow
def test_lora_trainer(tmp_path):
    """A LoRA policy's trainer pushes its merged weights to a plain model on the rollout rank: at max_staleness 0
    the synchronous run's adapters bit for bit and its sampled tokens (the rollout logprobs differ in the 7th
    digit: merged weights against PEFT's unmerged adapter matmuls)."""
    recipe, sets = REPO / "recipes" / "quickstart_lora.toml", ["steps=2", "data.prompts_per_step=8"]
    ppo_one_process(recipe, tmp_path / "sync", *sets)
    ppo_torchrun(2, recipe, tmp_path / "async", *sets, "async.max_staleness=0")
    final = Path("checkpoints") / "step_000002"
    assert (tmp_path / "async" / final / "adapter.safetensors").exists()
    assert_same_weights(tmp_path / "sync" / final, tmp_path / "async" / final)
    ours, theirs = (read_jsonl(tmp_path / run / "step_000002" / "rollouts.jsonl") for run in ("async", "sync"))
    assert [r["response_ids"] for r in ours] == [r["response_ids"] for r in theirs]
    diffs = [abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x["rollout_logprobs"], y["rollout_logprobs"])]
    assert max(diffs) < 1e-5


@pytest.mark.slow
def test_a_step_with_longer_prompts_waits_for_a_larger_stream(tmp_path):
    """The rollout rank sizes its one stream for the first step's prompts (with room to spare): a later step whose
    prompts are much longer waits for the stream to drain and gets a larger one (on a GPU the decode graphs'
    block tables are as wide as the stream was sized for; on CPU this checks the drain-and-reopen path runs)."""
    lines = [{"id": f"s{i}", "prompt": f"{i}+1=", "ground_truth": str(i + 1)} for i in range(8)]
    lines += [{"id": f"l{i}", "prompt": "1+" * 20 + f"{i}=", "ground_truth": str(i + 20)} for i in range(8)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    recipe = write_recipe(tmp_path, "max_staleness = 1")
    sets = ["steps=2", 'rollout.engine="native"', f'data.prompts="{tmp_path / "prompts.jsonl"}"']
    ppo_torchrun(2, recipe, tmp_path / "run", *sets)
    check_staleness(tmp_path / "run", 2, 1)
    assert {r["prompt_id"][0] for r in read_jsonl(tmp_path / "run" / "step_000002" / "rollouts.jsonl")} == {"l"}


@pytest.mark.slow
def test_quickstart_learns_asynchronously(tmp_path):
    run = tmp_path / "run"
    # 100 of the recipe's 150 steps: the reward's gain (steps 1-5 -> 96-100) was 0.59 at seed 1 (0.84 at 150)
    sets = ["seed=1", "steps=100", "async.max_staleness=1", "keep_artifacts=true"]
    ppo_torchrun(2, REPO / "recipes" / "quickstart.toml", run, *sets)
    metrics = read_jsonl(run / "metrics.jsonl")
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= first + 0.3, (first, last)
    assert max(check_staleness(run, len(rewards), 1)) == 1
    assert all(m["async/staleness_max"] <= 1 for m in metrics)


def _launched_rank(launcher_pid: int, rank: int) -> int | None:
    """The pid of the process torchrun started as RANK=rank (its children carry RANK in their environment)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


@pytest.mark.slow
def test_a_stalled_rollout_rank_fails_the_run_with_a_timeout(tmp_path):
    """A rollout rank that stops answering (SIGSTOP) ends the trainers within RLX_COLLECTIVE_TIMEOUT_S with a
    one-line error, instead of a hang."""
    recipe, run = write_recipe(tmp_path), tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-endpoint=localhost:0"]
    command += ["--rdzv-backend=c10d"]
    command += ["-m", "rlx", "ppo", str(recipe), "--out", str(run), "--set", "steps=1000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "RLX_COLLECTIVE_TIMEOUT_S": "8"}
    log = (tmp_path / "log").open("w")
    proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while not (run / "checkpoints" / "step_000002").exists() and time.time() < deadline:
        time.sleep(0.01)
    rollout, trainer = _launched_rank(proc.pid, 0), _launched_rank(proc.pid, 1)
    assert rollout and trainer, "no torchrun workers found"
    os.kill(rollout, signal.SIGSTOP)
    stalled = time.time()
    while Path(f"/proc/{trainer}").exists() and time.time() < stalled + 60:
        time.sleep(0.1)
    waited = time.time() - stalled
    os.kill(rollout, signal.SIGKILL)  # the launcher's SIGTERM would wait on a stopped process
    assert proc.wait(timeout=60) != 0
    text = (tmp_path / "log").read_text()
    assert waited < 40, waited
    assert "rlx ppo: error:" in text and "timed out" in text, text[-3000:]


def read_steps(run: Path, steps: int, name: str = "rollouts.jsonl") -> list[list[dict]]:
    return [read_jsonl(run / f"step_{step:06d}" / name) for step in range(1, steps + 1)]


@pytest.mark.slow
def test_dynamic_sampling_at_max_staleness_0_is_the_synchronous_run(tmp_path):
    """score.filter_groups (DAPO dynamic sampling) until filled (max_gen_batches 0: 3-4 batches a step; at seed 1
    step 3's batches hold 5 informative groups, of which the first 4 are kept): 2 rollout ranks + 1 trainer (their
    counts exchanged, shares merged batch by batch) at max_staleness 0 train the synchronous run's samples in its
    order: the same weights, metrics and data positions. One rollout rank with dynamic sampling at max_staleness 0:
    tests/distributed/test_dynamic_multi_turn.py::test_dynamic_sampling_of_episodes_sync_and_async."""
    sets = ["seed=1", "steps=3", "data.prompts_per_step=4", "score.filter_groups=true", "data.max_gen_batches=0"]
    (tmp_path / "sync").mkdir()
    ppo_one_process(write_recipe(tmp_path / "sync", None), tmp_path / "sync" / "run", *sets)
    sync = tmp_path / "sync" / "run"
    theirs = read_jsonl(sync / "metrics.jsonl")
    assert max(m["dynamic_sampling/gen_batches"] for m in theirs) > 1
    assert all(m["dynamic_sampling/kept_groups"] == 4 for m in theirs)
    recipe = write_recipe(tmp_path, "max_staleness = 0")
    run = tmp_path / "async2"
    ppo_torchrun(3, recipe, run, *sets, "async.rollout_ranks=2")
    assert_same_weights(sync / "checkpoints" / "step_000003", run / "checkpoints" / "step_000003")
    assert check_staleness(run, 3, 0) == [0, 0, 0]
    for a, b in zip(theirs, read_jsonl(run / "metrics.jsonl"), strict=True):
        keys = ("reward/mean", "actor/pg_loss", "actor/entropy", "batch/num_samples", "rollout/tokens")
        for key in (*keys, "dynamic_sampling/gen_batches", "dynamic_sampling/kept_groups"):
            assert a[key] == b[key], key
    for ours, sync_records in zip(read_steps(run, 3), read_steps(sync, 3)):
        assert [{k: v for k, v in r.items() if k not in ("policy_version", "rollout_restarts")} for r in ours] == (
            sync_records
        )
    assert read_steps(run, 3, "scores.jsonl") == read_steps(sync, 3, "scores.jsonl")
    for step in (1, 2, 3):
        meta = (
            run / "checkpoints" / f"step_{step:06d}" / "rlx.json",
            sync / "checkpoints" / f"step_{step:06d}" / "rlx.json",
        )
        assert json.loads(meta[0].read_text())["data_position"] == json.loads(meta[1].read_text())["data_position"]


@pytest.mark.slow
def test_dynamic_sampling_within_the_staleness_bound(tmp_path):
    """score.filter_groups at max_staleness 1 (native engine, 2 rollout ranks, at most 2 batches a step): every
    step completes and trains only informative groups, each sample within the bound, from the prompts the step
    drew (its data positions), and reports its batches and kept groups."""
    run = tmp_path / "run"
    sets = ["steps=4", "score.filter_groups=true", "data.max_gen_batches=2", 'rollout.engine="native"']
    ppo_torchrun(3, write_recipe(tmp_path, "max_staleness = 1\nrollout_ranks = 2"), run, *sets)
    assert max(check_staleness(run, 4, 1)) == 1
    prompts = [json.loads(line)["id"] for line in (REPO / "recipes/data/arith_quickstart.jsonl").open()]
    metrics, position = read_jsonl(run / "metrics.jsonl"), 0
    for step, (records, scores) in enumerate(zip(read_steps(run, 4), read_steps(run, 4, "scores.jsonl")), 1):
        line = metrics[step - 1]
        batches = line["dynamic_sampling/gen_batches"]
        assert 1 <= batches <= 2 and line["dynamic_sampling/kept_groups"] == len({r["prompt_id"] for r in records})
        drawn = prompts[position : position + 8 * int(batches)]
        position += 8 * int(batches)
        meta = json.loads((run / "checkpoints" / f"step_{step:06d}" / "rlx.json").read_text())
        assert meta["data_position"] == position
        assert [r["prompt_id"] for r in records] == sorted((r["prompt_id"] for r in records), key=drawn.index)
        groups = {}
        for s in scores:
            groups.setdefault(s["prompt_id"], []).append(s["reward"])
        assert groups and all(len(g) == 4 and len(set(g)) > 1 for g in groups.values()), (step, groups)
        assert line["async/staleness_max"] <= 1
    assert any(m["dynamic_sampling/gen_batches"] == 2 for m in metrics)


def test_dynamic_sampling_keeps_the_first_groups_in_batch_then_rank_order():
    """The cut over rollout ranks: counts[j][r] informative groups of rank r in batch j; the first `want` in
    (batch, rank) order are kept, and the merged shares come back batch by batch, rank by rank."""
    import torch

    from rlx.ppo.dynamic_sampling import kept_groups, merge_kept
    from rlx.scoring.score import Rewards

    counts = [[1, 0], [2, 3], [4, 4]]  # want 5: 1 + 0, then 2 of rank 0 and 2 of rank 1's 3; batch 3 not reached
    assert [kept_groups(counts, r, 5) for r in (0, 1)] == [3, 2]
    assert [kept_groups(counts, r, 100) for r in (0, 1)] == [7, 7]
    assert kept_groups([[3]], 0, 2) == 2

    def part(names, sizes):
        return (
            names,
            Rewards(torch.arange(len(names), dtype=torch.float32), [{} for _ in names], [None] * len(names)),
            sizes,
        )

    records, rewards = merge_kept([part(["a0", "a1", "b0"], [2, 1]), part(["c0", "d0", "d1"], [1, 2])])
    assert records == ["a0", "a1", "c0", "b0", "d0", "d1"]
    assert rewards.scores.tolist() == [0, 1, 0, 2, 1, 2]


def test_runs_of_tokens_per_policy():
    """How a sample's updates become its record's policy_versions: an update before any new token replaces the
    run it would start, one after the last token is dropped."""
    from rlx.ppo.async_rollout import _token_runs

    assert _token_runs([[0, 3]], 5) == [[0, 3]]
    assert _token_runs([[0, 3], [0, 4], [2, 5], [2, 6], [5, 7]], 5) == [[0, 4], [2, 6]]
    assert _token_runs([[0, 3], [4, 4]], 5) == [[0, 3], [4, 4]]


def test_bench_async_step_arguments_and_length_caps():
    """bench/async_step.py: its modes are checked, and one sample id in 16 (by hash, the same in every mode) gets
    the long cap."""
    sys.path.insert(0, str(REPO / "bench"))
    import async_step

    from rlx.formats.records import PromptRecord
    from rlx.rollout.config import SamplingParams
    from rlx.rollout.requests import Request

    args = async_step.parse_args(["--modes", "sync,async2", "--steps", "3"])
    assert args.modes == "sync,async2" and args.long_len == 2048 and args.short_len == 256
    small = async_step.parse_args(["--small", "--cpu", "--long-len", "200"])  # lengths within the tiny context
    assert (small.long_len, small.short_len, small.prompt_len) == (200, 16, 16)
    with pytest.raises(SystemExit):
        async_step.parse_args(["--modes", "sync,bogus"])
    sampling = SamplingParams(n=16, max_new_tokens=100)
    prompts = [PromptRecord(id=f"p{i}", prompt="x") for i in range(8)]
    requests = [Request(p, i, [1, 2]) for p in prompts for i in range(16)]
    caps = [r.max_new_tokens for r in async_step.capped_token_requests(4, 64, 16)(requests, sampling)]
    assert set(caps) == {4, 64} and 2 <= caps.count(64) <= 20, caps.count(64)
    assert caps == [r.max_new_tokens for r in async_step.capped_token_requests(4, 64, 16)(requests, sampling)]


def assert_multi_turn_async_equals_sync(tmp_path: Path, keys: tuple[str, ...], *sets: str) -> None:
    """The multi-turn recipe (with `sets`) at [async] max_staleness 0 on 2 ranks against one synchronous process:
    the same final weights, episodes (all but the async bookkeeping) and metrics `keys`."""
    (tmp_path / "sync").mkdir()
    (tmp_path / "sync" / "recipe.toml").write_text(MULTI_TURN)
    (tmp_path / "recipe.toml").write_text(MULTI_TURN + "[async]\nmax_staleness = 0\n")
    ppo_one_process(tmp_path / "sync" / "recipe.toml", tmp_path / "sync" / "run", *sets)
    ppo_torchrun(2, tmp_path / "recipe.toml", tmp_path / "async", *sets)
    sync, run = tmp_path / "sync" / "run", tmp_path / "async"
    assert_same_weights(sync / "checkpoints" / "step_000003", run / "checkpoints" / "step_000003")
    for step in ("step_000001", "step_000003"):
        ours = read_jsonl(run / step / "rollouts.jsonl")
        assert all(r["loss_mask"] and r["num_turns"] >= 1 for r in ours)
        assert [{k: v for k, v in r.items() if k not in ("policy_version", "rollout_restarts")} for r in ours] == (
            read_jsonl(sync / step / "rollouts.jsonl")
        )
    for a, b in zip(read_jsonl(sync / "metrics.jsonl"), read_jsonl(run / "metrics.jsonl")):
        for key in keys:
            assert a[key] == b[key], key


def test_a_rollout_rank_serves_the_rendezvous_of_the_engine_it_starts():
    """An [async] rollout rank has no default process group, so vLLM 0.26 makes its world of one through a tcp://
    address; under torchrun (TORCHELASTIC_USE_AGENT_STORE) torch.distributed would only connect to that address as a
    client, and the start hung. Inside `own_rendezvous` it serves the address, and the flag is back afterwards."""
    out = run_torchrun(1, WORKERS / "vllm_rendezvous.py", "bare").stdout
    assert "rendezvous bare: failed" in out
    out = run_torchrun(1, WORKERS / "vllm_rendezvous.py", "hidden").stdout
    assert "rendezvous hidden: ok, agent store flag True" in out
