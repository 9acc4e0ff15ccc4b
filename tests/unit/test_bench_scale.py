"""bench/scale.py's step summary: the steady step leaves out the early steps and the final save."""

from __future__ import annotations

import importlib.util

from tests.conftest import REPO


def _scale():
    spec = importlib.util.spec_from_file_location("bench_scale", REPO / "bench" / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_steady_step_is_the_later_half_without_the_final_save():
    # the 7B run of 2026-11-27 (bench/RESULTS.md, Scale, eleventh session): steps 2-4 pin the checkpoint buffers
    steps = [46.09, 6.75, 9.72, 8.69, 4.61, 4.80]
    metrics = [{"timing/step_s": s, "timing/save_s": 0.01} for s in steps]
    metrics[-1]["timing/save_s"] = 0.46
    scale = _scale()
    assert scale.steady_step_s(metrics) == 4.61  # median of 8.69, 4.61 and 4.80 - 0.46
    summary = scale.summarize(metrics, [95.0 + i for i in range(6)], gpus=4)
    assert summary["median_s"] == 6.75 and summary["steady_s"] == 4.61
    assert scale.steady_step_s(metrics[:1]) == 46.09


def test_the_host_memory_against_the_plan_s_share_a_rank():
    """Rank 0's largest host RSS over the steps, and the plan's host peaks per rank from its printed block."""
    scale = _scale()
    text = "rlx ppo: memory plan ...\n  host: peak GiB load 129, steady 101 of 421 usable of 468 (4 ranks per host)\n"
    assert scale.plan_host(text) == {"load": 32.25, "steady": 25.25} and scale.plan_host("no host line") == {}
    metrics = [{"timing/step_s": 5.0, "memory/train_host_rss_gb": rss, "memory/save_host_rss_gb": 1.0}
               for rss in (2.8, 28.5, 43.3)]  # fmt: skip
    assert scale.summarize(metrics, [1.0, 2.0, 3.0], gpus=4)["host_rss_gib_rank0"] == 43.3


def test_independent_runs_each_see_one_gpu_and_are_labelled_by_it(monkeypatch):
    """--independent N: copy i runs with CUDA_VISIBLE_DEVICES=i (a run of its own, no launcher), and its table row
    names the GPU; the launcher's runs keep the caller's devices."""
    scale = _scale()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert scale.env(2)["CUDA_VISIBLE_DEVICES"] == "2" and scale.env()["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert scale._gpus_label({"gpus": 1, "independent_on": 3}) == "1@3" and scale._gpus_label({"gpus": 4}) == "4"


def test_the_warm_up_runs_two_steps_on_one_gpu_and_a_failed_run_shows_its_log(tmp_path, monkeypatch, capsys):
    """--warm-up: two unmeasured steps of the first shape on one GPU before the measured runs; a failed run's row says
    so and its log's end follows the table (the 2-GPU run's one line of it did not tell why it failed)."""
    scale = _scale()
    calls = []

    def fake_run(recipe, gpus, run_dir, args, limit_s, device=None):
        calls.append((gpus, args.steps, run_dir.name))
        return [], [], "Traceback ...\nRuntimeError: the reason"

    monkeypatch.setattr(scale, "run", fake_run)
    monkeypatch.setattr(scale, "write_recipe", lambda work, shape, args, gpus: work / "recipe.toml")
    args = scale.argparse.Namespace(steps=6, timeout_s=420.0)
    scale.warm_up("0.5b", tmp_path, args)
    assert calls == [(1, 2, "run")] and args.steps == 6
    assert "warm-up (0.5b, 1 GPU, 2 steps)" in capsys.readouterr().out
    plan = {"fits": True, "peaks_gib": {"train": 10.0}}
    scale.print_table([{"shape": "0.5b", "gpus": 2, "plan": plan, "error": "Traceback ...\nRuntimeError: the reason"}])
    out = capsys.readouterr().out
    assert "failed: its log's end below the table" in out and out.rstrip().endswith("RuntimeError: the reason")
