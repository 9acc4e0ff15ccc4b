"""Data-parallel commands under torchrun (gloo, CPU): FSDP2 train steps equal one process; packing,
token budgets, offload and checkpointing change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import (
    WORKERS,
    cli_ok,
    max_diff,
    read_jsonl,
    rollout_args,
    run_torchrun,
    torchrun,
    torchrun_commands,
    write_length_reward,
)

TRAIN = ["--lr", "1e-4", "--mini-batch-size", "12", "--micro-batch-size", "3", "--epochs", "2"]


@pytest.fixture(scope="module")
def batch(tmp_path_factory, tiny_ckpt, prompts_file):
    d = tmp_path_factory.mktemp("dist")
    reward = write_length_reward(d)
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, d / "r.jsonl", "--max-new-tokens", "5", "--num-prompts", "6"))
    cli_ok(
        "score",
        "--rollouts",
        d / "r.jsonl",
        "--actor",
        tiny_ckpt,
        "--ref",
        tiny_ckpt,
        "--reward",
        f"{reward}:score",
        "--out",
        d,
    )
    return d / "batch.safetensors"


@pytest.fixture(scope="module")
def single(tmp_path_factory, tiny_ckpt, batch):
    out = tmp_path_factory.mktemp("single") / "c1"
    cli_ok("train-step", "--checkpoint", tiny_ckpt, "--batch", batch, "--out", out, "--kl-loss-coef", "0.1", *TRAIN)
    return out


ONE_UPDATE = ["--lr", "1e-4", "--micro-batch-size", "3"]


@pytest.fixture(scope="module")
def from_train(tmp_path_factory, tiny_ckpt, batch):
    """The batch's rollouts scored with old_logprobs = 'train', and one process's step on it (its metrics line)."""
    d = tmp_path_factory.mktemp("from_train")
    reward = write_length_reward(d)
    rollouts = batch.parent / "r.jsonl"
    cli_ok("score", "--rollouts", rollouts, "--actor", tiny_ckpt, "--reward", f"{reward}:score", "--out", d,
           "--old-logprobs", "train")  # fmt: skip
    cli_ok("train-step", "--checkpoint", tiny_ckpt, "--batch", d / "batch.safetensors", "--out", d / "c1", *ONE_UPDATE,
           "--metrics", d / "m.jsonl")  # fmt: skip
    return d


def test_two_ranks_equal_one(tmp_path, tiny_ckpt, batch, single):
    """2-rank steps equal one process: plain FSDP; with parameter and activation offload and gradient checkpointing;
    Ulysses SP 2 (each rank of the group runs a slice of the packed row). One launch runs the three."""
    step = ["train-step", "--checkpoint", tiny_ckpt, "--batch", batch, "--kl-loss-coef", "0.1", *TRAIN]
    torchrun_commands(
        2,
        [*step, "--out", tmp_path / "c", "--metrics", tmp_path / "m.jsonl"],
        [*step, "--out", tmp_path / "offload", "--param-offload", "--activation-offload", "--gradient-checkpointing",
         "--use-packing"],
        [*step, "--out", tmp_path / "sp", "--use-packing", "--sp-degree", "2"],
    )  # fmt: skip
    for name in ("c", "offload", "sp"):
        assert max_diff(single, tmp_path / name) < 1e-6, name
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 1  # rank 0 alone writes


def test_one_launched_rank_with_cpu_offload_equals_one_process(tmp_path, tiny_ckpt, batch, single):
    """torchrun with one process can offload (FSDP over one rank: what the memory plan offers a model whose float32
    state does not fit one GPU)."""
    step = ["train-step", "--checkpoint", tiny_ckpt, "--batch", batch, "--kl-loss-coef", "0.1", *TRAIN]
    torchrun_commands(1, [*step, "--out", tmp_path / "offload", "--param-offload"])
    assert max_diff(single, tmp_path / "offload") < 1e-6


def test_packing_and_token_budget_equal_padded_micro_batches(tmp_path, tiny_ckpt, batch, single):
    cli_ok(
        "train-step",
        "--checkpoint",
        tiny_ckpt,
        "--batch",
        batch,
        "--out",
        tmp_path / "c",
        "--kl-loss-coef",
        "0.1",
        *TRAIN,
        "--use-packing",
        "--max-tokens-per-micro-batch",
        "30",
    )
    assert max_diff(single, tmp_path / "c") < 1e-6


def test_four_ranks_with_token_budget_and_sequence_parallel(tmp_path, tiny_ckpt, batch, single, from_train):
    """4-rank steps equal one process: a token budget with every micro-batch reduce-scattered (two ranks above
    accumulate unsharded); dp 2 x Ulysses SP 2, packed, with a token budget and chunked logprobs; kept gathered
    layers; a batch whose old logprobs come from the step's forward (dp 2 x SP 2: each data-parallel rank's rows
    gathered for the mismatch metrics). One launch runs them."""
    step = ["train-step", "--checkpoint", tiny_ckpt, "--batch", batch, "--kl-loss-coef", "0.1", *TRAIN]
    own = ["train-step", "--checkpoint", tiny_ckpt, "--batch", from_train / "batch.safetensors", *ONE_UPDATE]
    torchrun_commands(
        4,
        [*step, "--out", tmp_path / "c", "--max-tokens-per-micro-batch", "25", "--grad-accumulation", "sharded"],
        [*step, "--out", tmp_path / "sp", "--use-packing", "--sp-degree", "2", "--max-tokens-per-micro-batch", "40",
         "--logprob-impl", "chunked"],
        [*step, "--out", tmp_path / "kept", "--max-tokens-per-micro-batch", "25", "--keep-gathered"],
        [*own, "--out", tmp_path / "own", "--use-packing", "--sp-degree", "2", "--max-tokens-per-micro-batch", "40",
         "--metrics", tmp_path / "own.jsonl"],
    )  # fmt: skip
    for name in ("c", "sp", "kept"):
        assert max_diff(single, tmp_path / name) < 1e-6, name
    assert max_diff(from_train / "c1", tmp_path / "own") < 1e-6
    one, four = read_jsonl(from_train / "m.jsonl")[-1], read_jsonl(tmp_path / "own.jsonl")[-1]
    assert four["actor/old_logprobs_from_train"] == 1.0
    for key in ("rollout_corr/logprob_abs_diff_mean", "rollout_corr/logprob_abs_diff_max", "rollout_corr/kl_k1"):
        assert abs(four[key] - one[key]) < 1e-6, (key, one[key], four[key])


def test_kept_gathered_layers_are_gathered_once_per_phase():
    """train.keep_gathered under FSDP2 at 2 ranks: three micro-batches' forward and backward, and three scoring
    forwards, all-gather each unit once per phase (21 / 10 all-gathers without) with bit-identical gradients, and
    leave the model resharded."""
    out = run_torchrun(2, WORKERS / "keep_gathered.py", timeout=300)
    assert "rank 0: kept gathered, all-gathers 4/4" in out.stdout and "rank 1: kept gathered" in out.stdout


def test_rollout_and_score_split_across_ranks(tmp_path, tiny_ckpt, prompts_file):
    """Each rank samples and scores its share; rank 0 writes files equal to a single process's."""
    from rlx.formats.batch import TrainBatch

    args = ["--num-samples", "3", "--num-prompts", "5", "--max-new-tokens", "4", "--batch-size", "4"]
    cli_ok("rollout", "--model", tiny_ckpt, "--prompts", prompts_file, "--out", tmp_path / "r1.jsonl", *args)
    score = ["--actor", tiny_ckpt, "--ref", tiny_ckpt, "--reward", "arith", "--micro-batch-size", "4"]
    torchrun_commands(  # both 2-rank commands in one launch
        2,
        ["rollout", "--model", tiny_ckpt, "--prompts", prompts_file, "--out", tmp_path / "r2.jsonl", *args],
        ["score", "--rollouts", tmp_path / "r1.jsonl", "--out", tmp_path / "s2", *score],
    )
    one = [line.split('"rollout_logprobs"')[0] for line in (tmp_path / "r1.jsonl").read_text().splitlines()]
    two = [line.split('"rollout_logprobs"')[0] for line in (tmp_path / "r2.jsonl").read_text().splitlines()]
    assert one == two  # same samples (ids, tokens, text) in the same order
    cli_ok("score", "--rollouts", tmp_path / "r1.jsonl", "--out", tmp_path / "s1", *score)
    assert (tmp_path / "s1" / "scores.jsonl").read_text() == (tmp_path / "s2" / "scores.jsonl").read_text()
    a, b = (
        TrainBatch.load(tmp_path / "s1" / "batch.safetensors"),
        TrainBatch.load(tmp_path / "s2" / "batch.safetensors"),
    )
    for name, tensor in a.tensors().items():
        assert (tensor.float() - b.tensors()[name].float()).abs().max() < 1e-6, name


def test_ppo_on_two_ranks_equals_one_and_resumes(tmp_path):
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.toml"
    small = ["--set", "data.prompts_per_step=6", "--set", "rollout.sampling.n=4", "--set", "save_every=1"]
    cli_ok("ppo", recipe, "--out", tmp_path / "one", "--set", "steps=3", *small)
    torchrun(2, "ppo", recipe, "--out", tmp_path / "two", "--set", "steps=2", *small)
    stale = tmp_path / "two" / "step_000003" / ".parts-killed"  # a killed launch's share: never read, removed
    stale.mkdir(parents=True)
    (stale / "rollouts.jsonl.00001").write_text("{}\n")
    torchrun(2, "ppo", recipe, "--out", tmp_path / "two", "--set", "steps=3", *small, "--resume")
    final = Path("checkpoints") / "step_000003"
    assert max_diff(tmp_path / "one" / final, tmp_path / "two" / final) < 1e-5
    one = [
        line["reward/mean"]
        for line in map(__import__("json").loads, (tmp_path / "one" / "metrics.jsonl").read_text().splitlines())
    ]
    two_lines = list(map(__import__("json").loads, (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()))
    assert one == [line["reward/mean"] for line in two_lines]  # same samples, same rewards, step by step
    for step in ("step_000001", "step_000002", "step_000003"):  # each rank wrote its share of the records
        runs = [read_jsonl(tmp_path / run / step / "rollouts.jsonl") for run in ("one", "two")]
        assert [[(r["id"], r["response_ids"]) for r in rows] for rows in runs] == [
            [(r["id"], r["response_ids"]) for r in runs[0]]
        ] * 2
        scores = [read_jsonl(tmp_path / run / step / "scores.jsonl") for run in ("one", "two")]
        assert [s["reward"] for s in scores[0]] == [s["reward"] for s in scores[1]]
        assert not list((tmp_path / "two" / step).glob(".parts-*"))
    for line in two_lines:  # under the launcher the rollout phase's parts: the rank's own share and the gather
        assert line["timing/generate_local_s"] > 0 and line["timing/generate_gather_s"] >= 0
        assert line["timing/generate_local_s"] + line["timing/generate_gather_s"] <= line["timing/rollout_s"]


def test_fsdp_layout_writes_shards_per_rank_and_reloads_at_another_world_size(tmp_path, tiny_ckpt, batch, single):
    """A 2-rank step on the 'fsdp' (DCP) layout writes the same weights as the 'single' layout; a
    1-process step then resumes from those shards (weights and Adam state) as from the single copy."""
    cli_ok("shard", "--model", tiny_ckpt, "--out", tmp_path / "s", "--layout", "fsdp")
    step = ["--batch", batch, "--kl-loss-coef", "0.1", *TRAIN]
    torchrun(2, "train-step", "--checkpoint", tmp_path / "s", "--out", tmp_path / "c", *step)
    names = sorted(p.name for p in (tmp_path / "c" / "dcp").iterdir())  # __<rank>_<writer thread>.distcp
    assert names[0] == ".metadata" and {name.split("_")[2] for name in names[1:]} == {"0", "1"}
    assert not (tmp_path / "c" / "model.safetensors").exists()
    cli_ok("merge", "--checkpoint", tmp_path / "c", "--out", tmp_path / "m")
    assert max_diff(single, tmp_path / "m") < 1e-6
    cli_ok("train-step", "--checkpoint", tmp_path / "c", "--out", tmp_path / "c2", *step)
    cli_ok("train-step", "--checkpoint", single, "--out", tmp_path / "d2", *step)
    cli_ok("merge", "--checkpoint", tmp_path / "c2", "--out", tmp_path / "m2")
    assert max_diff(tmp_path / "d2", tmp_path / "m2") < 1e-6


def test_ppo_with_critic_under_sequence_parallelism_equals_one_process(tmp_path):
    """Actor and critic both packed and split over an SP group of 2 (the rollout meanwhile decodes with
    SDPA and a KV cache on the same model): the same run as one process."""
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart_gae.toml"
    sets = ["data.prompts_per_step=4", "rollout.sampling.n=4", "steps=2", "train.use_packing=true"]
    sets += ["critic.train.use_packing=true", "train.mini_batch_size=8", "critic.train.mini_batch_size=8"]
    args = [a for s in sets for a in ("--set", s)]
    cli_ok("ppo", recipe, "--out", tmp_path / "one", *args)
    sp = ["--set", "train.sp_degree=2", "--set", "critic.train.sp_degree=2"]
    torchrun(2, "ppo", recipe, "--out", tmp_path / "two", *args, *sp)
    final = Path("checkpoints") / "step_000002"
    assert max_diff(tmp_path / "one" / final, tmp_path / "two" / final) < 1e-5
    assert max_diff(tmp_path / "one" / final / "critic", tmp_path / "two" / final / "critic") < 1e-5


def test_compiled_decoder_layers_equal_eager(tmp_path, tiny_ckpt, batch, single):
    """--compile wraps each decoder layer's forward in torch.compile (attention stays eager)."""
    step = ["--batch", batch, "--kl-loss-coef", "0.1", *TRAIN, "--use-packing", "--compile"]
    cli_ok("train-step", "--checkpoint", tiny_ckpt, "--out", tmp_path / "c", *step)
    assert max_diff(single, tmp_path / "c") < 1e-5


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "apertus"])
def test_other_families_train_under_fsdp_and_sp(tmp_path, family, prompts_file):
    """Qwen2 (q/k/v biases), Qwen3 (q/k norms) and Apertus (xIELU MLP, untied head): a 2-rank packed
    step with SP=2 equals one process."""
    import transformers

    from rlx.models.tiny import build_char_tokenizer

    if not hasattr(transformers, "ApertusConfig") and family == "apertus":
        pytest.skip("this transformers has no Apertus")
    tokenizer = build_char_tokenizer()
    classes = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "apertus": "ApertusConfig"}
    config = getattr(transformers, classes[family])(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=family != "apertus", pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    cli_ok("shard", "--model", tmp_path / "src", "--init", "random", "--out", tmp_path / "ck")
    cli_ok(*rollout_args(tmp_path / "ck", prompts_file, tmp_path / "r.jsonl", "--num-prompts", "4"))
    score = ["--rollouts", tmp_path / "r.jsonl", "--actor", tmp_path / "ck", "--reward", "arith"]
    cli_ok("score", *score, "--out", tmp_path)
    # --mini-batch-size 8 divides the 16 samples (TRAIN's 12 is refused); the later value of an option wins
    step = ["--checkpoint", tmp_path / "ck", "--batch", tmp_path / "batch.safetensors", *TRAIN]
    step += ["--use-packing", "--mini-batch-size", "8"]
    cli_ok("train-step", *step, "--out", tmp_path / "one")
    torchrun(2, "train-step", *step, "--out", tmp_path / "two", "--sp-degree", "2")
    assert max_diff(tmp_path / "one", tmp_path / "two") < 1e-6


def test_ppo_stops_when_one_rank_fails(tmp_path):
    """A rank that fails mid-run leaves at once (no final barrier the others never reach): the launcher stops
    the others and the error is reported, instead of every rank waiting out the collective timeout."""
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.toml"
    reward = tmp_path / "rw.py"
    reward.write_text(
        "import os\n"
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise ConnectionError('reward server unreachable')\n"
        "    return 0.0\n"
    )
    args = ["--set", "steps=2", "--set", "data.prompts_per_step=4", "--set", f"score.reward={reward}:score"]
    out = run_torchrun(2, "-m", "rlx", "ppo", recipe, "--out", tmp_path / "run", *args, timeout=300, check=False,
                       env={"RLX_COLLECTIVE_TIMEOUT_S": "600"})  # fmt: skip
    assert out.returncode != 0
    assert "reward server unreachable" in out.stdout + out.stderr, out.stderr[-3000:]


def test_a_mini_batch_smaller_than_the_ranks_is_refused_before_the_run_starts(tmp_path):
    """~15 s: train.mini_batch_size 1 under 2 ranks leaves a rank without a sample each optimizer step: refused as
    `rlx ppo` starts (not after step 1's rollout, at its train phase), naming the key, the ranks and the sizes that
    work, with nothing written."""
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.toml"
    args = ["--set", "steps=1", "--set", "data.prompts_per_step=2", "--set", "rollout.sampling.n=2",
            "--set", "rollout.sampling.max_new_tokens=4", "--set", "train.mini_batch_size=1"]  # fmt: skip
    out = run_torchrun(2, "-m", "rlx", "ppo", recipe, "--out", tmp_path / "run", *args, timeout=300, check=False)
    assert out.returncode == 1, out.stderr[-3000:]
    said = "train.mini_batch_size: 1 is fewer samples than the 2 data-parallel ranks (2 training processes)"
    assert said in out.stderr and "sizes that work (dividing a step's 4 samples, 2 or more): 2, 4, or 0" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mini_batch", [0, 12])
def test_exact_ppo_on_two_ranks_has_no_rollout_mismatch(tmp_path, mini_batch):
    """exact = true under the launcher (the trainer FSDP-sharded, the native engine generating from its replica of the
    shards): the rollout's logprobs equal the trainer's at every step, with the rollout's as the old logprobs (one
    mini-batch) and with the score phase's exact forward (two)."""
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.toml"
    args = ["--set", "steps=2", "--set", "data.prompts_per_step=6", "--set", "rollout.sampling.n=4", "--set",
            "exact=true", "--set", "rollout.engine=native", "--set", f"train.mini_batch_size={mini_batch}"]  # fmt: skip
    torchrun(2, "ppo", recipe, "--out", tmp_path / "run", *args)
    lines = list(map(__import__("json").loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()))
    assert len(lines) == 2
    for line in lines:
        assert line["score/old_logprobs_from_rollout"] == float(mini_batch == 0)
        assert line["rollout_corr/logprob_abs_diff_max"] == 0.0 and line["rollout_corr/kl_k1"] == 0.0, line


def test_exact_trainer_stacks_find_fsdp_unsharded_parameters():
    """Exact mode's trainer-side projection stacks on an FSDP2-sharded model (2 ranks): one linear call a set, the
    loss and gradients the unstacked model's."""
    done = run_torchrun(2, "tests/distributed/workers/exact_stacks_fsdp.py", timeout=300)
    assert "stacks equal" in done.stdout


def test_sharded_weights_gathered_by_bucket_equal_the_plain_model():
    """What a rollout engine is handed from FSDP2 shards (rows split unevenly over 3 ranks, one all-gather a bucket)."""
    done = run_torchrun(3, "tests/distributed/workers/gathered_weights.py", timeout=300)
    assert "gathered weights equal" in done.stdout
