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
    for lines, message in (('{"step": 1}\n{"step": 2, "re\n{"step": 3}\n', "metrics.jsonl:2: malformed JSON"),
                           ('{"step": 1}\n{"step": "x"}\n', "metrics.jsonl:2: expected a metrics object with "
                                                              "an integer 'step'")):  # fmt: skip
        (tmp_path / "cut" / "metrics.jsonl").write_text(lines)
        bad = cli("report", tmp_path / "cut")
        assert bad.exit_code == 1 and message in bad.stderr, bad.stderr


def test_report_on_a_real_ppo_run(tmp_path):
    run = tmp_path / "run"
    small = ["--set", "steps=3", "--set", "data.prompts_per_step=4", "--set", "rollout.sampling.n=2"]
    cli_ok("ppo", QUICKSTART, "--out", run, *small)
    cli_ok("report", run)
    report = run / "report"
    for name in ("reward", "response_length", "kl", "entropy", "clip_frac"):
        assert_png(report / f"{name}.png")
    summary = (report / "summary.md").read_text()
    rewards = [json.loads(line)["reward/mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "- status: finished (3 of 3 steps)" in summary
    assert f"-> {sum(rewards) / 3:.4f} (last 3 steps)" in summary


def test_every_plot_labels_its_y_axis_and_a_bounded_reward_band_stays_in_bounds():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from rlx.stages.report import PLOTS, band, build_figure

    every_key = {key for spec in PLOTS for key in spec.keys}
    steps = {s: {key: 0.5 for key in every_key} for s in (1, 2, 3)}
    for s, mean in ((1, 0.9), (2, 0.1), (3, 0.5)):  # a 0/1 reward: mean ± std would leave [0, 1]
        steps[s].update({"reward/mean": mean, "reward/std": 0.45, "reward/min": 0.0, "reward/max": 1.0})
    for spec in PLOTS:
        fig = build_figure(plt, spec, steps)
        try:
            assert fig.axes[0].get_ylabel(), spec.name
            if spec.name == "reward":
                (shaded,) = fig.axes[0].collections
                ys = shaded.get_paths()[0].vertices[:, 1]
                assert ys.min() == 0.0 and ys.max() == 1.0
        finally:
            plt.close(fig)
    xs, lower, upper = band(steps, "reward/mean", "reward/std", ("reward/min", "reward/max"))
    assert xs == [1, 2, 3] and lower == pytest.approx([0.45, 0.0, 0.05]) and upper == pytest.approx([1.0, 0.55, 0.95])
    del steps[2]["reward/min"], steps[2]["reward/max"]  # no bounds recorded: the plain band
    assert band(steps, "reward/mean", "reward/std", ("reward/min", "reward/max"))[1][1] == pytest.approx(-0.35)
