"""Adding a rollout engine, a training backend or a checkpoint layout is one class and one registry entry: the
smallest example of each, driven through the real commands."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlx.backends import registry as backends
from rlx.backends.base import Degrees, TrainingBackend
from rlx.checkpoints import registry as layouts
from rlx.checkpoints.base import Layout
from rlx.checkpoints.files import write_aux
from rlx.checkpoints.loading import load_model
from rlx.checkpoints.registry import read_full_optimizer
from rlx.logprobs import ModuleScorer
from rlx.models.loading import read_weights
from rlx.parallel.dist import DistContext
from rlx.rollout import registry as engines
from rlx.rollout.base import LocalGeneration, RolloutEngine
from rlx.rollout.requests import Generated
from rlx.training.actor import ActorTrainer
from rlx.training.critic import CriticTrainer
from rlx.utils.io import atomic_dir
from tests.conftest import REPO, cli_ok, read_jsonl, rollout_args


class EchoEngine(RolloutEngine):
    """A fourth rollout engine: answers every prompt with its own last token, then stops (logprob 0)."""

    name = "echo"

    def generate_local(self, requests, sampling, progress):
        eos = min(self.stop_ids)
        return LocalGeneration([Generated([r.prompt_ids[-1], eos], [0.0, 0.0], "stop") for r in requests])


class PlainBackend(TrainingBackend):
    """A third training backend: one process, the shared trainers on an unsharded module, even under a launcher."""

    name = "plain"

    @classmethod
    def setup(cls, device, degrees: Degrees):
        return cls(DistContext(device=torch.device("cpu")))

    def build_trainer(self, model, cfg, where="", optimizer_state=None):
        trainer = (CriticTrainer if cfg.role == "critic" else ActorTrainer)(model, cfg, self.ctx.device,
                                                                             torch.float32, self.ctx)  # fmt: skip
        trainer.load_optimizer_state(optimizer_state, where)
        return trainer

    def load_trainer(self, cfg, source, config):
        model = load_model(source, cfg.role, config=config)
        return self.build_trainer(model, cfg, str(source.path), read_full_optimizer(source.path))

    def scorer(self, trainer):
        return ModuleScorer(trainer.model, self.ctx)

    def build_reference(self, model):
        return ModuleScorer(model.requires_grad_(False).eval(), self.ctx)

    def load_scoring_model(self, source, role, config):
        return ModuleScorer(load_model(source, role, config=config), self.ctx)


class PerTensorLayout(Layout):
    """A fourth checkpoint layout: one safetensors file per tensor under tensors/."""

    name = "per-tensor"

    def read_full_weights(self, folder, config=None):
        return {p.stem: load_file(p)["t"] for p in sorted((folder / "tensors").glob("*.safetensors"))}

    def write_full(self, out, weights, aux, meta, config, overwrite):
        with atomic_dir(out, overwrite=overwrite) as tmp:
            (tmp / "tensors").mkdir()
            for name, tensor in weights.items():
                save_file({"t": tensor.contiguous()}, str(tmp / "tensors" / f"{name}.safetensors"))
            write_aux(tmp, aux)
            meta.write(tmp)

    def write(self, out, parts, overwrite, before_publish=None):
        part = parts[""]
        weights = part.state.full_weights()
        if part.state.is_main:
            self.write_full(out, weights, part.aux, part.meta, None, overwrite)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(engines._ENGINES, "echo", EchoEngine)
    monkeypatch.setitem(backends._BACKENDS, "plain", PlainBackend)
    monkeypatch.setitem(layouts._LAYOUTS, "per-tensor", PerTensorLayout())


def test_a_fourth_rollout_engine(registered, tmp_path, tiny_ckpt, prompts_file):
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "r.jsonl", "--engine", "echo"))
    records = read_jsonl(tmp_path / "r.jsonl")
    assert len(records) == 16 and all(r["response_ids"][0] == r["prompt_ids"][-1] for r in records)


def test_a_third_training_backend_runs_the_ppo_loop(registered, tmp_path):
    recipe = REPO / "recipes" / "quickstart.toml"
    for backend in ("plain", "fsdp"):
        cli_ok("ppo", recipe, "--out", tmp_path / backend, "--set", "steps=2", "--set", f"backend={backend}")
    one, two = (read_jsonl(tmp_path / b / "metrics.jsonl") for b in ("plain", "fsdp"))
    assert [m["reward/mean"] for m in one] == [m["reward/mean"] for m in two]
    final = [read_weights(tmp_path / b / "checkpoints" / "step_000002") for b in ("plain", "fsdp")]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_a_fourth_checkpoint_layout(registered, tmp_path, tiny_dir, prompts_file):
    ckpt = tmp_path / "ckpt"
    cli_ok("shard", "--model", tiny_dir, "--init", "random", "--out", ckpt, "--layout", "per-tensor")
    assert (ckpt / "tensors").is_dir() and not (ckpt / "model.safetensors").exists()
    cli_ok("merge", "--checkpoint", ckpt, "--out", tmp_path / "hf")
    reference = tmp_path / "ref"
    cli_ok("shard", "--model", tiny_dir, "--init", "random", "--out", reference)
    assert all(
        torch.equal(a, b) for a, b in zip(read_weights(tmp_path / "hf").values(), read_weights(reference).values())
    )
    cli_ok(*rollout_args(ckpt, prompts_file, tmp_path / "r.jsonl"))
    cli_ok("score", "--rollouts", tmp_path / "r.jsonl", "--actor", ckpt, "--reward", "arith", "--out", tmp_path / "s")
    cli_ok(
        "train-step", "--checkpoint", ckpt, "--batch", tmp_path / "s" / "batch.safetensors", "--out", tmp_path / "c1"
    )
    assert (tmp_path / "c1" / "tensors").is_dir()  # the next checkpoint keeps the layout
