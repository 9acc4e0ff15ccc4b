"""`rlx train-step`: exact gradient accumulation, optimizer state through checkpoints, metrics."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict

import pytest
import torch

from rlx.checkpoints.loading import load_model
from rlx.errors import UserError
from rlx.formats.batch import TrainBatch
from rlx.models.loading import read_weights, resolve_source
from rlx.training.actor import ActorTrainer
from rlx.training.config import OptimConfig, TrainConfig
from tests.conftest import cli, cli_ok, rollout_args, write_length_reward


@pytest.fixture(scope="module")
def batch_path(tmp_path_factory, tiny_ckpt, prompts_file):
    d = tmp_path_factory.mktemp("b")
    reward = write_length_reward(d)
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, d / "r.jsonl", "--max-new-tokens", "5", "--num-prompts", "2"))
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


def gradients(ckpt, batch: TrainBatch, **cfg) -> dict[str, torch.Tensor]:
    trainer = ActorTrainer(load_model(resolve_source(ckpt)), TrainConfig(**cfg), torch.device("cpu"), torch.float32)
    trainer.accumulate_gradients(batch, defaultdict(float))
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def assert_close_grads(a, b):
    for name in a:
        scale = a[name].abs().max().clamp(min=1e-8)
        assert (a[name] - b[name]).abs().max() / scale < 1e-5, name


def test_micro_batching_does_not_change_the_gradient(tiny_ckpt, batch_path):
    batch = TrainBatch.load(batch_path)
    assert batch.size == 8 and batch.advantages.abs().sum() > 0
    one_big = gradients(tiny_ckpt, batch, micro_batch_size=8)
    assert_close_grads(one_big, gradients(tiny_ckpt, batch, micro_batch_size=1))
    assert_close_grads(one_big, gradients(tiny_ckpt, batch, micro_batch_size=3))


def test_token_budget_micro_batches_are_even_and_keep_the_gradient(tiny_ckpt, batch_path, monkeypatch):
    """Packed micro-batches by token budget: the consecutive packing's count, re-split into parts of near-equal work
    (no one-sample sliver at the end), the gradient that of one big micro-batch."""
    batch = TrainBatch.load(batch_path)
    one_big = gradients(tiny_ckpt, batch, micro_batch_size=8)
    tokens = (batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).tolist()
    budget = sum(sorted(tokens)[:7])  # the consecutive packing: 7 samples (or fewer), then the rest
    seen = []
    original = ActorTrainer.micro_step
    monkeypatch.setattr(ActorTrainer, "micro_step", lambda self, t, part, *a: seen.append(part.size) or original(
        self, t, part, *a))  # fmt: skip
    packed = gradients(tiny_ckpt, batch, use_packing=True, max_tokens_per_micro_batch=budget)
    assert len(seen) == 2 and sum(seen) == 8 and max(seen) - min(seen) <= 2, seen
    assert_close_grads(one_big, packed)


def test_padding_does_not_change_the_gradient(tiny_ckpt, batch_path):
    batch = TrainBatch.load(batch_path)
    pad = lambda t, left, right, value: torch.nn.functional.pad(t, (left, right), value=value)  # noqa: E731
    padded = dataclasses.replace(
        batch,
        prompt_ids=pad(batch.prompt_ids, 3, 0, 0),
        prompt_mask=pad(batch.prompt_mask, 3, 0, False),
        **{
            k: pad(getattr(batch, k), 0, 2, 0)
            for k in (
                "response_ids",
                "response_mask",
                "loss_mask",
                "rollout_logprobs",
                "old_logprobs",
                "ref_logprobs",
                "token_rewards",
                "advantages",
                "returns",
            )
        },
    )
    assert_close_grads(gradients(tiny_ckpt, batch), gradients(tiny_ckpt, padded))


def test_two_cli_steps_equal_two_resident_steps(tmp_path, tiny_ckpt, batch_path):
    """Optimizer state and step count travel through the checkpoint exactly."""
    args = ["--batch", batch_path, "--lr", "1e-2", "--warmup-steps", "3", "--mini-batch-size", "4"]
    cli_ok("train-step", "--checkpoint", tiny_ckpt, "--out", tmp_path / "c1", *args)
    cli_ok("train-step", "--checkpoint", tmp_path / "c1", "--out", tmp_path / "c2", *args)
    trainer = ActorTrainer(
        load_model(resolve_source(tiny_ckpt)),
        TrainConfig(optim=OptimConfig(lr=1e-2, warmup_steps=3), mini_batch_size=4),
        torch.device("cpu"),
        torch.float32,
    )
    batch = TrainBatch.load(batch_path)
    m1, m2 = trainer.train_step(batch, 0), trainer.train_step(batch, 1)
    assert m1["actor/lr"] == pytest.approx(1e-2 / 3) and m2["actor/lr"] == pytest.approx(2e-2 / 3)
    stored = read_weights(tmp_path / "c2")
    for name, param in trainer.model.state_dict().items():
        if name in stored:
            assert torch.equal(stored[name], param), name
    meta = json.loads((tmp_path / "c2" / "rlx.json").read_text())
    assert meta["step"] == 2 and meta["optimizer"]["name"] == "adamw"
    assert meta["provenance"]["created_by"] == "rlx train-step"


def test_metrics_line(tmp_path, tiny_ckpt, batch_path):
    metrics = tmp_path / "m.jsonl"
    cli_ok(
        "train-step",
        "--checkpoint",
        tiny_ckpt,
        "--batch",
        batch_path,
        "--out",
        tmp_path / "c1",
        "--epochs",
        "2",
        "--mini-batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--lr",
        "1e-3",
        "--metrics",
        metrics,
    )
    line = json.loads(metrics.read_text())
    assert line["step"] == 1 and line["actor/num_updates"] == 4 and line["actor/lr"] == 1e-3
    for key in (
        "actor/loss",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/grad_norm",
        "perf/actor_tokens_per_s",
    ):
        assert isinstance(line[key], float), key
    assert line["actor/entropy"] > 0 and line["actor/grad_norm"] > 0
    assert line["actor/ppo_kl"] != 0  # the second epoch sees a changed policy


def test_kl_loss_needs_ref_logprobs(tmp_path, tiny_ckpt, prompts_file):
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "r.jsonl"))
    cli_ok("score", "--rollouts", tmp_path / "r.jsonl", "--actor", tiny_ckpt, "--out", tmp_path)
    result = cli(
        "train-step",
        "--checkpoint",
        tiny_ckpt,
        "--batch",
        tmp_path / "batch.safetensors",
        "--out",
        tmp_path / "c1",
        "--kl-loss-coef",
        "0.1",
    )
    assert result.exit_code == 1 and "--ref" in result.stderr and not (tmp_path / "c1").exists()


def test_a_step_improves_the_rewarded_sequences(tmp_path, tiny_ckpt, batch_path):
    """The update raises the logprob of positive-advantage samples relative to negative ones."""
    cli_ok("train-step", "--checkpoint", tiny_ckpt, "--batch", batch_path, "--out", tmp_path / "c1", "--lr", "1e-2")
    from rlx.logprobs import batched_response_logprobs

    batch = TrainBatch.load(batch_path)
    tensors = batch.tensors()
    after = batched_response_logprobs(
        load_model(resolve_source(tmp_path / "c1")),
        tensors,
        batch.meta.temperature,
        torch.device("cpu"),
        torch.float32,
        8,
    )
    gain = ((after - batch.old_logprobs) * batch.response_mask).sum(-1)
    seq_adv = batch.advantages[:, 0]
    assert gain[seq_adv > 0].mean() > gain[seq_adv < 0].mean()


def test_lr_schedule_options(tmp_path, tiny_ckpt, batch_path):
    """--lr-schedule linear|cosine needs --lr-decay-steps by hand; the step's lr follows the checkpoint's step."""
    args = ["train-step", "--batch", batch_path, "--lr", "1e-2", "--lr-schedule", "cosine"]
    result = cli(*args, "--checkpoint", tiny_ckpt, "--out", tmp_path / "c1")
    assert result.exit_code == 1 and "--lr-decay-steps: lr schedule 'cosine' needs the decay length" in result.stderr
    assert not (tmp_path / "c1").exists()
    metrics = tmp_path / "m.jsonl"
    args += ["--lr-decay-steps", "2", "--min-lr-ratio", "0.1", "--metrics", metrics]
    cli_ok(*args, "--checkpoint", tiny_ckpt, "--out", tmp_path / "c1")
    cli_ok(*args, "--checkpoint", tmp_path / "c1", "--out", tmp_path / "c2")
    cli_ok(*args, "--checkpoint", tmp_path / "c2", "--out", tmp_path / "c3")
    lrs = [json.loads(line)["actor/lr"] for line in metrics.read_text().splitlines()]
    assert lrs == pytest.approx([1e-2, 1e-2 * (0.1 + 0.9 * 0.5), 1e-3])  # cos(pi / 2) half-way, the floor at 2


def test_a_checkpoint_prepared_before_an_update_holds_the_weights_of_before(tmp_path, tiny_ckpt, batch_path):
    """The ppo loop prepares a checkpoint, hands its writing to a background thread and trains on: the files
    hold the weights and optimizer state of the moment of `prepare_save`, not of the next update."""
    from rlx.checkpoints.meta import CheckpointMeta
    from rlx.checkpoints.registry import prepare_save, read_full_optimizer

    cfg = TrainConfig(optim=OptimConfig(lr=1e-2))
    trainer = ActorTrainer(load_model(resolve_source(tiny_ckpt)), cfg, torch.device("cpu"), torch.float32)
    batch = TrainBatch.load(batch_path)
    trainer.train_step(batch, 0)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    moments = {k: v.clone() for k, v in trainer.optimizer_state().items()}
    meta = CheckpointMeta(step=1, layout="single", optimizer=trainer.optimizer_meta())
    aux = {"config.json": trainer.config.to_json_string().encode()}
    write = prepare_save(tmp_path / "ckpt", trainer, aux, meta)
    trainer.train_step(batch, 1)  # updates the parameters and AdamW moments in place
    write()
    stored = read_weights(tmp_path / "ckpt")
    assert stored and all(torch.equal(stored[k], before[k]) for k in stored)
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    optimizer = read_full_optimizer(tmp_path / "ckpt")
    assert optimizer.keys() == moments.keys() and all(torch.equal(optimizer[k], moments[k]) for k in moments)


def test_a_mini_batch_size_that_does_not_divide_the_batch(tmp_path, tiny_ckpt, batch_path):
    """--mini-batch-size 3 on a batch of 8 would make optimizer steps of 3, 3 and 2: refused before any model is
    loaded, naming the sizes and the nearest that divide 8, nothing written. A batch of dynamic sampling (`rlx score
    --filter-groups`, recorded in the batch) varies in size from step to step: the same words as a warning, and the
    step trains (three updates)."""
    common = ["train-step", "--checkpoint", tiny_ckpt, "--mini-batch-size", "3"]
    refused = cli(*common, "--batch", batch_path, "--out", tmp_path / "c1")
    assert refused.exit_code == 1 and not (tmp_path / "c1").exists()
    assert (
        f"--mini-batch-size: 3 does not divide the 8 samples of {batch_path}: 2 optimizer steps of 3 and one of 2 "
        "each epoch; nearest sizes that divide it: 2 or 4"
    ) in refused.stderr
    folder = batch_path.parent
    cli_ok("score", "--rollouts", folder / "r.jsonl", "--actor", tiny_ckpt, "--reward",
           f"{folder / 'length_reward.py'}:score", "--filter-groups", "--out", tmp_path / "filtered")  # fmt: skip
    filtered = tmp_path / "filtered" / "batch.safetensors"
    assert TrainBatch.load(filtered).meta.settings["filter_groups"] is True
    metrics = tmp_path / "m.jsonl"
    kept = cli_ok(*common, "--batch", filtered, "--out", tmp_path / "c2", "--metrics", metrics)
    assert "rlx train-step: warning: --mini-batch-size 3 does not divide the 8 samples" in kept.stderr
    assert "(a batch of dynamic sampling: its size varies)" in kept.stderr
    assert json.loads(metrics.read_text().splitlines()[-1])["actor/num_updates"] == 3
    cli_ok(*common[:-1], "4", "--batch", batch_path, "--out", tmp_path / "c3")  # 4 divides 8


def test_a_mini_batch_smaller_than_the_data_parallel_ranks_is_refused_before_the_model_loads(
    tmp_path, tiny_ckpt, batch_path, monkeypatch
):
    """Under a launcher each optimizer step splits its mini-batch over the data-parallel ranks, a sample or more each:
    --mini-batch-size 2 over 4 ranks (the launch faked: a process group of 4 as the backend sees it) is refused as
    `rlx ppo` refuses a recipe, before the model is loaded and with nothing written, naming the flag, the ranks and the
    sizes that work; so are a batch smaller than the ranks and an uneven cut whose last mini-batch is."""
    from rlx.backends.fsdp import FSDPBackend
    from rlx.parallel.dist import DistContext
    from rlx.stages.train_step import check_data_parallel_batch

    world = [4]
    monkeypatch.setattr("rlx.backends.fsdp.setup", lambda device, sp_degree: DistContext(world=world[0]))
    monkeypatch.setattr(FSDPBackend, "load_trainer", lambda *a, **k: pytest.fail("the model was loaded"))
    args = ["train-step", "--checkpoint", tiny_ckpt, "--batch", batch_path, "--out", tmp_path / "c"]
    refused = cli(*args, "--mini-batch-size", "2")
    assert refused.exit_code == 1 and not (tmp_path / "c").exists()
    assert (
        "--mini-batch-size: 2 is fewer samples than the 4 data-parallel ranks (4 training processes): each optimizer "
        f"step splits its mini-batch over them, a sample or more each; sizes that work (dividing the 8 samples of "
        f"{batch_path}, 4 or more): 4, 8, or 0 (the whole batch in one optimizer step)"
    ) in refused.stderr
    world[0] = 16
    refused = cli(*args)
    assert refused.exit_code == 1
    assert f"--batch: the 8 samples of {batch_path} are fewer than the 16 data-parallel ranks" in refused.stderr
    with pytest.raises(UserError, match="^--mini-batch-size: 3 leaves a last mini-batch of 2, fewer than the 3 "
                       r"data-parallel ranks \(6 training processes, 2 to a model replica\)"):  # fmt: skip
        check_data_parallel_batch(TrainConfig(mini_batch_size=3), 8, "b", 3, 6)
    for mini, dp_size in ((0, 8), (4, 4), (3, 3), (1, 1)):  # 3 over 3: counts that do not divide are fine
        check_data_parallel_batch(TrainConfig(mini_batch_size=mini), 9 if mini == 3 else 8, "b", dp_size, dp_size)


def test_config_dtype_names_the_dtype_of_the_stored_weights(tmp_path, batch_path):
    """A bfloat16 model trains on float32 master weights, which is what `rlx sft` and train-step write: their
    config.json then says float32 (as save_pretrained records the weights it saved), in each layout, so that a loader
    taking the config's dtype gets the trained weights unrounded; `rlx merge` keeps it so (mending a checkpoint whose
    config still names another dtype) and records a cast; `rlx shard` keeps a source's config byte for byte. A config
    of an older transformers keeps its key, torch_dtype, in its sub-configs too."""
    from transformers import AutoModelForCausalLM

    from rlx.checkpoints.files import with_config_dtype
    from rlx.checkpoints.registry import read_full_weights
    from tests.conftest import save_tiny_hf, write_jsonl

    def dtypes(folder) -> tuple[str, set]:
        config = json.loads((folder / "config.json").read_text())
        return config["dtype"], {str(t.dtype) for t in read_full_weights(folder).values()}

    hf = save_tiny_hf(tmp_path / "hf", dtype=torch.bfloat16)
    assert dtypes(hf) == ("bfloat16", {"torch.bfloat16"})
    demos = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+2=", "response": "3"}])
    cli_ok("sft", "--model", hf, "--data", demos, "--out", tmp_path / "sft")
    assert dtypes(tmp_path / "sft") == ("float32", {"torch.float32"})
    for layout in ("single", "fsdp"):
        step0, step1 = tmp_path / f"{layout}0", tmp_path / f"{layout}1"
        cli_ok("shard", "--model", hf, "--layout", layout, "--out", step0)
        assert (step0 / "config.json").read_bytes() == (hf / "config.json").read_bytes()
        cli_ok("train-step", "--checkpoint", step0, "--batch", batch_path, "--out", step1)
        assert dtypes(step1) == ("float32", {"torch.float32"}), layout
    stale = tmp_path / "single1" / "config.json"  # as an older rlx wrote it
    stale.write_text(stale.read_text().replace('"float32"', '"bfloat16"'))
    cli_ok("merge", "--checkpoint", tmp_path / "single1", "--out", tmp_path / "merged")
    assert dtypes(tmp_path / "merged") == ("float32", {"torch.float32"})
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged").dtype == torch.float32
    cli_ok("merge", "--checkpoint", tmp_path / "fsdp1", "--out", tmp_path / "cast", "--dtype", "bfloat16")
    assert dtypes(tmp_path / "cast") == ("bfloat16", {"torch.bfloat16"})
    older = {"torch_dtype": "bfloat16", "text_config": {"torch_dtype": "bfloat16"}}  # older transformers' key, kept
    aux = with_config_dtype({"config.json": json.dumps(older).encode()}, read_full_weights(tmp_path / "single1"))
    assert json.loads(aux["config.json"]) == {"torch_dtype": "float32", "text_config": {"torch_dtype": "float32"}}
