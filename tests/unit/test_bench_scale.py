"""bench/scale.py: the steady step leaves out the early steps and the final save; the recipe's prompts are the
issue's length in tokens as `rlx ppo` loads the tokenizer."""

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


def test_every_prompt_is_prompt_len_tokens_as_rlx_loads_the_tokenizer(tmp_path):
    """For a qwen2 model dir transformers 5 loads the character tokenizer as Qwen2's byte-level BPE, which drops
    letters and spaces: the 0.5B runs' 127-character prompts were ~44 tokens, not 128. Digits are one token each."""
    import argparse
    import json

    from rlx.models.loading import load_tokenizer, resolve_source

    scale = _scale()
    args = argparse.Namespace(num_prompts=4, weak=False, steps=2, prompt_len=128, response_len=256, num_generations=8)
    for shape in ("0.5b", "7b"):
        scale.write_recipe(tmp_path / shape, shape, args)
        tokenizer = load_tokenizer(resolve_source(tmp_path / shape / f"model-{shape}"))
        lines = (tmp_path / shape / "prompts.jsonl").read_text().splitlines()
        assert len(lines) == 8
        for line in lines:
            assert len(tokenizer(json.loads(line)["prompt"])["input_ids"]) == 128, (shape, line)


def test_a_run_in_a_used_work_folder_replaces_the_old_run_and_never_reads_its_metrics(tmp_path, monkeypatch):
    """A second call with the same --work printed the first call's figures (rlx ppo refused the used --out and the
    old metrics.jsonl was read): the run is started with --overwrite and the old metrics are gone before it starts."""
    scale = _scale()
    run_dir = tmp_path / "run-0.5b-1"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"timing/step_s": 9.0}\n')
    seen = {}

    class FakeProcess:
        def __init__(self, cmd, **kwargs):
            seen["cmd"], seen["old_metrics"] = cmd, (run_dir / "metrics.jsonl").exists()
            (run_dir / "metrics.jsonl").write_text('{"timing/step_s": 1.5}\n')

        def poll(self):
            return 0

    monkeypatch.setattr(scale.subprocess, "Popen", FakeProcess)
    args = scale.argparse.Namespace(torchrun_one=False, launcher_args="", py_spy=None, cpu=False, set=[])
    monkeypatch.setattr(scale, "extra_sets", lambda args: [])
    metrics, arrivals, _ = scale.run(tmp_path / "recipe.toml", 1, run_dir, args, 10.0)
    assert "--overwrite" in seen["cmd"] and not seen["old_metrics"]
    assert metrics == [{"timing/step_s": 1.5}] and len(arrivals) == 1
