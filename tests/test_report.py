"""`rlx report`: PNGs and summary.md from a hand-written metrics.jsonl (with a cut last line and a
metric missing), bad run folders, and a report on a real `rlx ppo` run."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, cli, cli_ok

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUICKSTART = REPO / "recipes" / "quickstart.toml"
REWARDS = [0.1, 0.2, 0.15, 0.3, 0.4, 0.5, 0.45, 0.6, 0.7, 0.65]


def metrics_line(step: int) -> dict:
    return {
        "step": step,
        "reward/mean": REWARDS[step - 1],
        "reward/std": 0.1,
        "response_length/mean": 2.0 + step / 10,
        "actor/ref_kl": 0.001 * step,
        "actor/entropy": 2.5 - step / 10,
        "actor/pg_clipfrac": None if step == 1 else 0.01,  # null (NaN) at step 1
        "timing/step_s": 0.5 + 0.1 * (step % 2),
    }


def make_run(run_dir, steps: int, planned: int | None, cut_line: bool = True):
    run_dir.mkdir()
    if planned is not None:
        (run_dir / "recipe.json").write_text(json.dumps({"seed": 0, "steps": planned}))
    text = "".join(json.dumps(metrics_line(s)) + "\n" for s in range(1, steps + 1))
    if cut_line:  # a run in progress: the next line is half written
        text += json.dumps(metrics_line(steps + 1))[:40]
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


def assert_png(path):
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 2000, path


def test_report_on_a_run_in_progress(tmp_path):
    run = make_run(tmp_path / "run", steps=9, planned=10)
    result = cli_ok("report", run)
    report = run / "report"
    assert result.stdout.strip() == str(report / "summary.md")
    names = sorted(p.name for p in report.iterdir())
    # no perf/mfu in this run: no MFU plot; nothing else (no temporaries) in the folder
    assert names == ["clip_frac.png", "entropy.png", "kl.png", "response_length.png", "reward.png", "summary.md"]
    for name in names[:-1]:
        assert_png(report / name)
    summary = (report / "summary.md").read_text()
    assert "- status: not finished: 9 of 10 steps" in summary
    assert "- steps done: 9 of 10" in summary
    first, last = sum(REWARDS[:5]) / 5, sum(REWARDS[4:9]) / 5
    assert f"- reward/mean: {first:.4f} (first 5 steps) -> {last:.4f} (last 5 steps)" in summary
    assert "- best reward/mean: 0.7000 at step 9" in summary
    assert "- mean step time: 0.556 s over 9 steps" in summary  # (5 * 0.6 + 4 * 0.5) / 9, odd steps 0.6
    for name in names[:-1]:
        assert f"]({name})" in summary


def test_report_on_a_finished_run_and_again(tmp_path):
    run = make_run(tmp_path / "run", steps=10, planned=10, cut_line=False)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 10, "perf/mfu": 0.31}) + "\n")  # a second line for step 10 is merged
    cli_ok("report", run)
    summary = (run / "report" / "summary.md").read_text()
    assert "- status: finished (10 of 10 steps)" in summary and "best reward/mean: 0.7000 at step 9" in summary
    assert_png(run / "report" / "mfu.png")
    assert cli("report", run).exit_code == 1  # an earlier report is kept unless --overwrite
    cli_ok("report", run, "--overwrite")  # the report is rewritten in place
    assert (run / "report" / "summary.md").read_text() == summary


def test_report_without_recipe_says_so(tmp_path):
    run = make_run(tmp_path / "run", steps=3, planned=None)
    cli_ok("report", run)
    assert "- status: unknown (no recipe.json)" in (run / "report" / "summary.md").read_text()


def test_bad_run_folders_exit_1_with_one_line(tmp_path):
    missing = cli("report", tmp_path / "nope")
    assert missing.exit_code == 1 and "no such run folder" in missing.stderr
    (tmp_path / "empty").mkdir()
    no_metrics = cli("report", tmp_path / "empty")
    assert no_metrics.exit_code == 1 and "metrics.jsonl: no such file" in no_metrics.stderr
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "metrics.jsonl").write_text('{"step": 1, "rew')
    cut = cli("report", tmp_path / "cut")
    assert cut.exit_code == 1 and "no complete metrics line yet" in cut.stderr
    assert len(cut.stderr.strip().splitlines()) == 1 and not (tmp_path / "cut" / "report").exists()


def test_report_on_a_real_ppo_run(tmp_path):
    run = tmp_path / "run"
    small = ["--set", "steps=3", "--set", "data.prompts_per_step=4", "--set", "rollout.n=2"]
    cli_ok("ppo", QUICKSTART, "--out", run, *small)
    cli_ok("report", run)
    report = run / "report"
    for name in ("reward", "response_length", "kl", "entropy", "clip_frac"):
        assert_png(report / f"{name}.png")
    summary = (report / "summary.md").read_text()
    rewards = [json.loads(line)["reward/mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "- status: finished (3 of 3 steps)" in summary
    assert f"-> {sum(rewards) / 3:.4f} (last 3 steps)" in summary
