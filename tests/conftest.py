"""Shared fixtures: a tiny Llama with a character tokenizer, prompts, and an in-process CLI runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# CPU tests stay on the CPU even on a GPU machine (exact float32 comparisons); GPU tests opt in.
if not os.environ.get("RLX_TEST_GPU"):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest
import torch
from typer.testing import CliRunner

from rlx.cli import app
from rlx.models.tiny import build_char_tokenizer, tiny_llama_config, write_tiny_model_dir
from rlx.tasks.arith import generate_arith

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "distributed" / "workers"  # the scripts the torchrun tests launch
os.environ.setdefault("TQDM_DISABLE", "1")


class Result:
    """Exit code and captured streams of one in-process CLI call."""

    def __init__(self, exit_code: int, stdout: str, stderr: str, exception):
        self.exit_code, self.stdout, self.stderr, self.exception = exit_code, stdout, stderr, exception

    def __repr__(self) -> str:
        return f"<exit {self.exit_code}: stdout={self.stdout[-500:]!r} stderr={self.stderr[-2000:]!r}>"


def cli(*args: str | Path, input: str | None = None) -> Result:
    """Run `rlx ARGS` in this process (no interpreter start-up per call)."""
    result = CliRunner().invoke(app, [str(a) for a in args], input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Result(result.exit_code, result.stdout, result.stderr, result.exception)


def cli_ok(*args: str | Path, input: str | None = None) -> Result:
    result = cli(*args, input=input)
    assert result.exit_code == 0, result
    return result


def repo_first_path() -> str:
    """PYTHONPATH for a test's subprocess: this checkout first, then the caller's own entries (on the GPU machine,
    the folder vLLM was installed into with --target: a subprocess without it cannot import vllm)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess that runs `rlx` commands by name (a recipe's shell pipeline): this
    interpreter's `rlx` first on PATH, or with the test zygotes (tests/zygote.py) a shim that runs each command as a
    zygote's child, skipping the ~8 s of imports a command otherwise starts with."""
    env = {**os.environ, "PATH": _torchrun_env()["PATH"], **extra}
    zygotes = _zygotes()
    return zygotes.shim_env(env) if zygotes is not None else env


def _torchrun_env(extra: dict | None = None) -> dict[str, str]:
    """A torchrun run's environment: this interpreter's scripts first on PATH, the checkout first on PYTHONPATH, one
    thread a rank, then `extra`."""
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": repo_first_path(),
        "OMP_NUM_THREADS": "1",
        **(extra or {}),
    }


def run_torchrun(
    n: int, *args: str | Path, timeout: int = 600, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node n ARGS` (a script, or '-m', 'rlx', ...) with gloo on CPU, one thread per rank;
    with `check`, fails the test with the output tail on error. `env`: extra environment variables."""
    env = _torchrun_env(env)
    args = [str(a) for a in args]
    target = args[:2] if args[:1] == ["-m"] else args[:1]
    zygotes = _zygotes() if target and not target[0].startswith("--") else None
    if zygotes is not None and zygotes.usable_for(env):  # the ranks forked after the imports (tests/zygote.py)
        out = zygotes.run(n, target, args[len(target) :], env, REPO, timeout)
    else:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}"]
        command += ["--rdzv-endpoint=localhost:0", "--rdzv-backend=c10d", *args]
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if check:
        assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
    return out


_ZYGOTES = []


def _zygotes():
    """This pytest process's test zygotes (tests/zygote.py), started on first use in a plain torchrun run's environment
    (no test's extra variables); None with RLX_TEST_ZYGOTE=0."""
    if os.environ.get("RLX_TEST_ZYGOTE") == "0":
        return None
    if not _ZYGOTES:
        from tests.zygote import Zygotes

        _ZYGOTES.append(Zygotes(_torchrun_env(), REPO))
    return _ZYGOTES[0]


def pytest_unconfigure(config):
    for zygotes in _ZYGOTES:
        zygotes.close()


def run_script(script: Path, env: dict | None = None, *args: str) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` in a fresh interpreter (rlx and tests importable); `env`: extra environment variables."""
    env = {**os.environ, "PYTHONPATH": repo_first_path(), **(env or {})}
    command = [sys.executable, str(script), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO, timeout=600)


def torchrun(n: int, *args, timeout: int = 600) -> subprocess.CompletedProcess:
    """`rlx ARGS` in n processes (gloo on CPU); fails the test with the output tail on error."""
    return run_torchrun(n, "-m", "rlx", *args, timeout=timeout)


def torchrun_commands(n: int, *commands: list, timeout: int = 600) -> subprocess.CompletedProcess:
    """Several `rlx` commands (each a list of arguments), one after the other, in one launch of n processes (gloo on
    CPU): the start-up and the imports are paid once (tests/distributed/workers/rlx_commands.py). Fails the test with
    the output tail on error."""
    args = [str(a) for command in commands for a in ("--then", *command)][1:]
    return run_torchrun(n, WORKERS / "rlx_commands.py", *args, timeout=timeout)


def flat_config(cls, **flat):
    """Config `cls` from flat field names, as its command's flags name them (`n=2`, `max_num_seqs=4`, `env=...` for
    RolloutConfig's sampling, native and agent tables), through the commands' own option builder."""
    from rlx.commands._options import build_from_options, field_options

    defaults = {p.name: p.default for p in field_options(cls)}
    unknown = set(flat) - set(defaults)
    assert not unknown, f"{cls.__name__} has no flat option {sorted(unknown)}"
    return build_from_options(cls, {**defaults, **flat})


def make_engine(model, tokenizer, cfg, device: torch.device | str = "cpu"):
    """The rollout engine `cfg.engine` around `model` in this process (no process group)."""
    from rlx.parallel.dist import DistContext
    from rlx.rollout.base import build_engine

    return build_engine(cfg, model, tokenizer, DistContext(device=torch.device(device)))


def generate(engine, prompts, cfg):
    """The records of `engine.generate` with `cfg`'s sampling settings."""
    return engine.generate(prompts, cfg.sampling, progress=False).records


def replayed_logprobs(prompt_ids: list[int], response_ids: list[int], runs: list[list[int]], policy) -> torch.Tensor:
    """The logprobs (temperature 1) of a response generated under changing weights, recomputed: `runs` lists
    [token index, version] where each policy's tokens begin, `policy(version)` gives that policy's model. The
    token at index i was sampled from the forward over the token before it, so that token's keys and values
    (and the later ones') come from the new policy, those before from the old ones, as an engine keeping its
    cache across an update computes them. [len(response_ids)]"""
    from transformers import DynamicCache

    ids = torch.tensor([prompt_ids + response_ids])
    cuts = [0] + [len(prompt_ids) + i - 1 for i, _ in runs[1:]] + [ids.shape[1] - 1]
    cache, logits = DynamicCache(), []
    with torch.no_grad():
        for start, end, (_, version) in zip(cuts, cuts[1:], runs):
            logits.append(policy(version)(ids[:, start:end], past_key_values=cache, use_cache=True).logits[0].float())
    logprobs = torch.log_softmax(torch.cat(logits)[len(prompt_ids) - 1 :], -1)
    return logprobs.gather(-1, torch.tensor(response_ids)[:, None]).squeeze(-1)


def write_length_reward(folder: Path) -> Path:
    """A dense custom reward (response length + 0.1 x sample index: every group has non-zero advantages);
    returns the file (pass `--reward FILE:score`)."""
    path = folder / "length_reward.py"
    path.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str)) + 0.1 * extra_info['sample_index']\n"
    )
    return path


def max_diff(a: Path, b: Path) -> float:
    """The largest absolute difference between the weights of two checkpoints (any layout) with the same names."""
    from rlx.checkpoints.registry import read_full_weights

    wa, wb = read_full_weights(a), read_full_weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))
    return Path(path)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """config.json + character tokenizer, no weights (for --init random)."""
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_dir, tmp_path_factory) -> Path:
    """An rlx checkpoint at step 0 of the tiny model (random init, seed 0)."""
    out = tmp_path_factory.mktemp("ckpt") / "step0"
    cli_ok("shard", "--model", tiny_dir, "--init", "random", "--seed", "0", "--out", out)
    return out


def save_tiny_hf(out: Path, dtype=torch.float32, tie: bool = True, seed: int = 0) -> Path:
    """A tiny Hugging Face model dir with weights (save_pretrained), for shard/merge tests."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(len(tokenizer))
    config.tie_word_embeddings = tie
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    return write_jsonl(path, generate_arith(64, seed=0, max_value=4))


def rollout_args(model: Path, prompts: Path, out: Path, *extra: str) -> list:
    return [
        "rollout",
        "--model",
        model,
        "--prompts",
        prompts,
        "--out",
        out,
        "--n",
        "4",
        "--max-new-tokens",
        "3",
        "--num-prompts",
        "4",
        *extra,
    ]


@pytest.fixture(scope="session")
def chat_ckpt(tiny_dir, tmp_path_factory) -> Path:
    """The tiny model with a chat template (each message's content then '=', a space to answer), random init."""
    import shutil

    from rlx.models.loading import ModelSource, load_tokenizer

    chat_dir = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_dir, chat_dir)
    tok = load_tokenizer(ModelSource(chat_dir))
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}={% endfor %}{% if add_generation_prompt %} {% endif %}"
    )
    tok.save_pretrained(chat_dir)
    out = tmp_path_factory.mktemp("chat_ckpt") / "step0"
    cli_ok("shard", "--model", chat_dir, "--init", "random", "--seed", "0", "--out", out)
    return out


# The slowest tests of the last full `make test` (seconds on one CI worker, 2 cores), by node id; refresh from
# `pytest --durations=30` of a full run (less the `@group` suffix of xdist_group tests). A test missing here starts
# after these, in file order.
SLOWEST = {
    "tests/stages/test_vision_stages.py::test_tiny_vlm_recipe_learns": 85.0,
    "tests/unit/test_exact_triton.py::test_exact_mode_end_to_end_through_the_triton_kernels_in_the_interpreter": 68.7,
    "tests/unit/test_vllm.py::test_torchrun_data_and_tensor_parallel_equal_one_process": 63.5,
    "tests/stages/test_verifiers_client.py::test_vf_eval_tool_rollout_is_one_token_exact_multi_turn_record": 62.1,
    "tests/stages/test_smollm2.py::test_smollm2_recipe_runs_a_step_on_cpu": 61.4,
    "tests/stages/test_verifiers_client.py::test_vf_eval_rollouts_are_recorded_token_exact_one_record_each": 57.0,
    "tests/stages/test_verifiers_ppo.py::test_verifiers_agent_errors_name_the_problem": 49.2,
    "tests/stages/test_family.py::test_ppo_gae_and_dapo_learn[quickstart_gae.toml]": 48.3,
    "tests/unit/test_vllm.py::test_ppo_with_vllm_learns_and_logs_the_sync": 48.1,
    "tests/unit/test_bench_resume.py::test_resume_check_finds_the_resumed_run_equal_to_the_whole_one": 48.0,
    "tests/distributed/test_async.py::test_staleness_bound_and_resume_after_a_kill": 45.6,
    "tests/stages/test_family.py::test_ppo_gae_and_dapo_learn[dapo_quickstart.toml]": 44.1,
    "tests/stages/test_verifiers_ppo.py::test_ppo_trains_a_verifiers_environment_with_its_rewards": 43.5,
    "tests/distributed/test_async.py::test_quickstart_learns_asynchronously": 42.4,
    "tests/unit/test_vllm.py::test_multi_turn_episodes_at_tp_2_equal_one_process": 41.2,
    "tests/distributed/test_async.py::test_a_stalled_rollout_rank_fails_the_run_with_a_timeout": 41.0,
    "tests/unit/test_exact_fused.py::test_engine_and_trainer_run_the_fused_kernels_and_agree_in_the_interpreter": 38.0,
    "tests/distributed/test_scale.py::test_sharded_background_checkpoints_resume_bit_exactly_and_two_nodes_equal_one": 36.6,  # noqa: E501
    "tests/distributed/test_megatron_moe.py::test_ppo_with_megatron_expert_and_tensor_parallelism_equals_one_process": 34.0,  # noqa: E501
    "tests/unit/test_exact_triton.py::test_exact_triton_kernels_in_the_interpreter": 33.7,
    "tests/distributed/test_async_vllm.py::test_multi_turn_episodes_at_max_staleness_0_are_the_synchronous_vllm_run": 32.3,  # noqa: E501
    "tests/distributed/test_async_vllm.py::test_within_the_bound_with_the_native_engines_artifacts": 32.3,
    "tests/distributed/test_async_vllm.py::test_lora_trainer_pushes_merged_weights_to_vllm": 30.4,
    "tests/distributed/test_async_vllm.py::test_max_staleness_0_is_the_synchronous_vllm_run": 30.2,
    "tests/distributed/test_megatron.py::test_pipeline_and_data_parallel_train_steps_equal_one_process": 28.5,
    "tests/stages/test_ppo.py::test_quickstart_learns_for_any_seed[3]": 28.1,
    "tests/stages/test_ppo.py::test_quickstart_learns_for_any_seed[1]": 27.7,
    "tests/distributed/test_async_vllm.py::test_resume_goes_on_within_the_bound": 24.2,
    "tests/distributed/test_megatron.py::test_score_equals_the_hf_path": 23.2,
    "tests/distributed/test_native_tp.py::test_rollout_command_with_tp_degree_2_equals_one_process": 22.4,
    "tests/distributed/test_megatron_moe.py::test_two_rank_train_steps_equal_one_process": 21.0,
    "tests/distributed/test_megatron_moe.py::test_four_rank_train_steps_equal_one_process": 20.3,
    "tests/distributed/test_megatron.py::test_ppo_with_critic_on_megatron_equals_one_process_and_resumes": 20.0,
    "tests/distributed/test_async_vllm.py::test_drop_restarts_samples_under_the_new_weights": 19.6,
    "tests/unit/test_exact_fused.py::test_fused_kernels_in_the_interpreter": 19.5,
    "tests/unit/test_memory.py::test_inductor_cache_hits_and_misses_are_counted": 18.3,
    "tests/distributed/test_megatron_moe.py::test_logprobs_equal_transformers[2-degrees1]": 18.3,
    "tests/stages/test_multi_turn_stages.py::test_calculator_shell_pipeline_equals_ppo": 18.1,
    "tests/distributed/test_distributed.py::test_four_ranks_with_token_budget_and_sequence_parallel": 18.1,
    "tests/distributed/test_dynamic_multi_turn.py::test_dynamic_sampling_of_episodes_sync_and_async": 17.7,
    "tests/unit/test_vision.py::test_sequence_parallel_with_straddling_images_equals_one_rank": 17.6,
    "tests/distributed/test_megatron.py::test_logprobs_entropy_and_values_equal_hf[2-2]": 16.7,
    "tests/distributed/test_moe_native.py::test_moe_bench_runs_on_the_tiny_shape": 16.6,
    "tests/stages/test_run_safety.py::test_sigterm_stops_after_a_checkpoint_and_resume_finishes": 16.5,
    "tests/distributed/test_distributed.py::test_compiled_decoder_layers_equal_eager": 15.4,
    "tests/stages/test_shard_merge.py::test_gguf_shard_matches_transformers_and_runs": 15.3,
    "tests/unit/test_devices.py::test_collective_timeout_is_a_one_line_error": 15.2,
    "tests/stages/test_ppo.py::test_resume_after_kill_gives_the_same_weights": 14.9,
    "tests/distributed/test_megatron.py::test_actor_and_critic_train_steps_with_tp2_equal_one_process": 14.6,
    "tests/stages/test_lora_stages.py::test_resume_after_kill_gives_the_same_adapters": 14.6,
    "tests/distributed/test_async.py::test_eval_on_the_rollout_ranks": 14.4,
    "tests/stages/test_sft.py::test_ppo_sft_under_torchrun_fine_tunes_on_every_rank": 14.3,
    "tests/distributed/test_megatron_moe.py::test_ppo_of_qwen2_moe_and_mixtral_on_megatron_equals_one_process[qwen2_moe-megatron.tp_degree=2]": 14.0,  # noqa: E501
    "tests/distributed/test_async.py::test_megatron_trainers": 14.0,
    "tests/unit/test_vllm.py::test_multi_turn_episodes_through_the_token_stream": 13.8,
    "tests/unit/test_kernels.py::test_triton_kernels_in_the_interpreter": 13.7,
    "tests/unit/test_kernels.py::test_vocab_parallel_equals_the_full_vocabulary[2]": 13.7,
    "tests/stages/test_multi_turn_stages.py::test_serve_command_records_the_openai_clients_trajectory": 13.6,
    "tests/stages/test_io_failures.py::test_a_file_size_limit_is_one_line_for_every_tensor_writer": 13.4,
    "tests/distributed/test_native_tp.py::test_two_tensor_parallel_ranks_sample_what_one_engine_samples": 13.3,
    "tests/distributed/test_megatron_moe.py::test_ppo_of_qwen2_moe_and_mixtral_on_megatron_equals_one_process[mixtral-train.ep_degree=2]": 13.0,  # noqa: E501
    "tests/stages/test_ppo.py::test_a_kill_during_a_background_checkpoint_write_resumes_bit_exactly": 12.5,
}


def pytest_collection_modifyitems(config, items):
    """Tests pinned to one worker (`xdist_group`: the vLLM tests; tests that share one launch of a module fixture)
    go first: under `-n 2 --dist loadgroup` that worker starts on them while the other takes the rest, instead of
    running them alone at the end. The others start longest first (SLOWEST), so the run does not end on one long
    test while the other worker idles."""
    items.sort(key=lambda item: (item.get_closest_marker("xdist_group") is None, -SLOWEST.get(item.nodeid, 0.0)))
    if getattr(config.option, "loadgroup", False):
        name_groups(items)


def name_groups(items) -> None:
    """The `@group` suffix that --dist loadgroup schedules by, on the node ids of a test worker's items. pytest-xdist
    3.8 writes it to `item._nodeid`, which pytest 9.2 no longer reads (its node id is `item._id`): without this, the
    tests of a group were spread over the workers like any others."""
    from _pytest.nodeid import NodeId

    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None and "@" not in item.nodeid and hasattr(item, "_id"):
            item._id = NodeId.parse(
                f"{item.nodeid}@{mark.args[0] if mark.args else mark.kwargs.get('name', 'default')}"
            )
