"""Tracking: the config's validation, metrics.jsonl + console always, every backend gets the same names
(tensorboard events, an offline wandb run, an MLflow file store, all read back), rollout traces, resume."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlx.config import ConfigError, from_dict
from rlx.errors import UserError
from rlx.observe.tracking import Tracker, TrackingConfig, reward_summary, select_traces
from tests.conftest import read_jsonl

RECIPE = {"seed": 0, "steps": 3, "train": {"optim": {"lr": 0.001}, "mini_batch_size": 8}, "model": {"path": "tiny"}}
STEP_METRICS = {
    1: {"reward/mean": 0.25, "reward/std": 0.5, "actor/pg_clipfrac": 0.0, "timing/rollout_s": 1.5},
    2: {"reward/mean": 0.5, "reward/std": 0.25, "actor/pg_clipfrac": 0.125, "timing/rollout_s": 1.25},
}


@dataclass
class Rollout:
    id: str
    prompt: str | list
    response: str
    is_greedy_baseline: bool = False


@dataclass
class Score:
    id: str
    reward: float
    advantage: float


def traces(n: int) -> tuple[list[Rollout], list[Score]]:
    rollouts = [Rollout(f"p{i // 2}/{i % 2}", f"{i}+1=", f"{i + 1}|ok") for i in range(n)]
    scores = [Score(r.id, float(i % 2), i - n / 2) for i, r in enumerate(rollouts)]
    return rollouts, scores


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backends,message",
    [
        (["console", "neptune"], "unknown tracker 'neptune' (valid trackers: console, tensorboard, wandb, mlflow)"),
        (["jsonl"], "metrics.jsonl is always written"),
        (["wandb", "wandb"], "wandb listed twice"),
    ],
)
def test_config_rejects_bad_backends_and_lists_the_valid_ones(backends, message):
    with pytest.raises(ConfigError) as e:
        TrackingConfig(backends=backends)
    assert e.value.key == "backends" and message in e.value.message


def test_config_from_a_recipe_table_names_the_key():
    assert from_dict(TrackingConfig, {"backends": [], "traces_per_step": 0}).backends == []
    with pytest.raises(ConfigError, match="traces_per_step: must be >= 0"):
        from_dict(TrackingConfig, {"traces_per_step": -1})
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(TrackingConfig, {"backend": ["console"]})


# -- metrics ----------------------------------------------------------------------------------------


def test_console_tracker_writes_metrics_jsonl_and_a_step_line(tmp_path, capsys):
    with Tracker(TrackingConfig(), tmp_path, RECIPE) as tracker:
        tracker.log(1, {**STEP_METRICS[1], "actor/ref_kl": math.nan})
        tracker.log(2, {**STEP_METRICS[1], "actor/ref_kl": -1e-7})
    err = capsys.readouterr().err
    assert "step 1/3  reward 0.250 ±0.500" in err and "kl nan" in err and "kl 0.0000" in err  # not -0.0000
    assert reward_summary([0.1, 0.2, 0.3]) == "reward 0.100 (first step) -> 0.300 (last step)"
    assert reward_summary([0.5]) == "reward 0.500 (1 step)"
    assert reward_summary(list(range(12))).endswith("(first 5 steps) -> 9.000 (last 5 steps)")
    line = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert line["step"] == 1 and line["reward/mean"] == 0.25 and line["actor/ref_kl"] is None


def test_no_backend_still_writes_metrics_jsonl(tmp_path, capsys):
    with Tracker(TrackingConfig(backends=[]), tmp_path, RECIPE) as tracker:
        tracker.log(1, STEP_METRICS[1])
    assert capsys.readouterr().err == ""
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["reward/std"] == 0.5


def tensorboard_scalars(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags["scalars"]}
    return scalars, tags["tensors"]


def test_every_backend_gets_the_same_metric_names(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    cfg = TrackingConfig(backends=["tensorboard", "wandb", "mlflow"], project="proj", run_name="r1")
    rollouts, scores = traces(6)
    with Tracker(cfg, tmp_path, RECIPE) as tracker:
        for step, metrics in STEP_METRICS.items():
            tracker.log(step, {**metrics, "actor/ref_kl": math.inf, "note": "text"})
            tracker.log_traces(step, select_traces(rollouts, scores, 3, seed=step))
    names = sorted(STEP_METRICS[1])

    scalars, tensor_tags = tensorboard_scalars(tmp_path)
    assert sorted(scalars) == names
    assert scalars["reward/mean"] == [(1, 0.25), (2, 0.5)]
    assert "traces/text_summary" in tensor_tags and "config/text_summary" in tensor_tags

    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    history = next(run.glob("run-*.wandb")).read_bytes()
    assert all(name.encode() in history for name in names) and b"actor/ref_kl" not in history
    tables = sorted((run / "files" / "media" / "table").glob("traces_*.table.json"))
    assert len(tables) == 2
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "id", "prompt", "response", "reward", "advantage"]
    assert len(table["data"]) == 3 and table["data"][0][0] == 1

    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlflow").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "proj"]
    (mlrun,) = client.search_runs([experiment.experiment_id])
    assert mlrun.info.run_name == "r1" and mlrun.info.status == "FINISHED"
    assert sorted(mlrun.data.metrics) == names
    assert [(m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, "reward/mean")] == [
        (1, 0.25),
        (2, 0.5),
    ]
    assert mlrun.data.params["train.optim.lr"] == "0.001" and mlrun.data.params["model.path"] == "tiny"

    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2] and lines[0]["actor/ref_kl"] is None
    assert lines[0]["note"] == "text"


def test_resume_continues_the_tracker_runs(tmp_path):
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")
    cfg = TrackingConfig(backends=["tensorboard", "mlflow"], traces_per_step=2)
    rollouts, scores = traces(4)
    with Tracker(cfg, tmp_path, RECIPE) as tracker:
        for step in (1, 2, 3):
            tracker.log(step, {"reward/mean": float(step)})
            tracker.log_traces(step, select_traces(rollouts, scores, 2, seed=step))
    # crashed after step 3 with the last checkpoint at step 2: step 3 is done again
    with Tracker(cfg, tmp_path, RECIPE, start_step=2) as tracker:
        assert [row["step"] for row in read_jsonl(tmp_path / "traces.jsonl")] == [1, 1, 2, 2]
        tracker.log(3, {"reward/mean": 30.0})
    scalars, _ = tensorboard_scalars(tmp_path)
    assert scalars["reward/mean"] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlflow").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "rlx"]
    (mlrun,) = client.search_runs([experiment.experiment_id])
    assert mlrun.info.run_name == tmp_path.name and mlrun.data.metrics["reward/mean"] == 30.0


@pytest.mark.parametrize("backend,package", [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_backend_that_is_not_installed_names_its_package(tmp_path, monkeypatch, backend, package):
    monkeypatch.setitem(sys.modules, package, None)  # import now raises ImportError
    with pytest.raises(UserError, match=f"tracker '{backend}' needs the {package} package: pip install"):
        Tracker(TrackingConfig(backends=["console", backend]), tmp_path, RECIPE)


def test_tracking_imports_without_torch_or_trackers():
    code = (
        "import sys, rlx.observe.tracking, rlx.observe.sinks; "
        "print([m for m in ('torch', 'wandb', 'mlflow', 'tensorboard') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- traces -----------------------------------------------------------------------------------------


def test_traces_are_appended_with_their_step(tmp_path):
    rollouts, scores = traces(8)
    with Tracker(TrackingConfig(backends=[], traces_per_step=2), tmp_path, RECIPE) as tracker:
        tracker.log_traces(1, select_traces(rollouts, scores, 2, seed=0))
        tracker.log_traces(2, select_traces(rollouts, scores, 2, seed=1))
    rows = read_jsonl(tmp_path / "traces.jsonl")
    assert [row["step"] for row in rows] == [1, 1, 2, 2]
    assert list(rows[0]) == ["step", "id", "prompt", "response", "reward", "advantage"]
    by_id = {r.id: (r, s) for r, s in zip(rollouts, scores)}
    for row in rows:
        rollout, score = by_id[row["id"]]
        assert (row["prompt"], row["response"]) == (rollout.prompt, rollout.response)
        assert (row["reward"], row["advantage"]) == (score.reward, score.advantage)


def test_traces_off_writes_nothing(tmp_path):
    rollouts, scores = traces(4)
    with Tracker(TrackingConfig(traces_per_step=0), tmp_path, RECIPE) as tracker:
        tracker.log_traces(1, select_traces(rollouts, scores, 4, seed=0))
    assert not (tmp_path / "traces.jsonl").exists()


def test_select_traces_is_deterministic_and_matches_scores_by_id():
    rollouts, scores = traces(20)
    rollouts.append(Rollout("greedy", "x", "y", is_greedy_baseline=True))
    scores.append(Score("greedy", 1.0, 0.0))
    shuffled = list(reversed(scores))  # matched by id, not position
    picked = select_traces(rollouts, shuffled, 5, seed=7)
    assert picked == select_traces(rollouts, scores, 5, seed=7)
    assert len(picked) == 5 and len({row["id"] for row in picked}) == 5
    assert select_traces(rollouts, scores, 5, seed=8) != picked
    order = [r.id for r in rollouts]
    assert [order.index(row["id"]) for row in picked] == sorted(order.index(row["id"]) for row in picked)
    everything = select_traces(rollouts, scores, 100, seed=0)
    assert [row["id"] for row in everything] == order[:-1]  # all but the greedy baseline
    assert select_traces(rollouts[:3], scores[1:3], 5, seed=0) == everything[1:3]
    assert select_traces(rollouts, scores, 0, seed=0) == []
