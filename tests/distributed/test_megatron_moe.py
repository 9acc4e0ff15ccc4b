"""A Qwen3-MoE on the megatron backend (megatron-core's MoE layer, gloo on CPU): logprobs equal transformers' at
expert parallel 1 and 2, and under tensor parallelism 2 (sequence parallel) with either; `rlx shard --layout
megatron` then `rlx merge` is byte-exact; a train step with the experts split over 2 ranks, the model over 2
tensor-parallel ranks or 2 stages (x 2 expert-parallel on 4), equals one process's (megatron and FSDP, FSDP's own
expert parallelism too); the router's load-balancing and z-losses give FSDP's update, also at tp 2 and pp 2 x tp 2;
rollout routing replay (R3) forces the recorded experts as the FSDP/HF path does (scoring and training, one process,
pp 2 x ep 2, tp 2 x ep 2, `rlx ppo`) with the same moe/* metrics; the router-loss metrics (actor/moe_aux_loss, ...)
equal FSDP's; Qwen2-MoE and Mixtral: logprobs and gradients equal transformers' (the shared launch), shard/merge is
byte-exact, their steps equal FSDP's (Qwen2-MoE: one process, tp 2; Mixtral: one process, ep 2); unsupported
settings and families (OLMoE) are one-line errors. The multi-rank train steps share one launch per world size
(tests/distributed/workers/rlx_commands.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from rlx.checkpoints.registry import read_full_weights  # noqa: E402
from tests.conftest import (  # noqa: E402
    REPO,
    WORKERS,
    cli,
    cli_ok,
    max_diff,
    read_jsonl,
    rollout_args,
    run_torchrun,
    torchrun,
    torchrun_commands,
    write_jsonl,
    write_length_reward,
)

# one optimizer step: after two at lr 1e-2 one expert's down_proj differs by 1.1e-5 between FSDP's own micro-batch
# sizes 1 and 2 (Adam on a near-zero gradient), and by 3.6e-5 between the backends. Adam's first update is
# lr * g / (|g| + eps): a gradient near eps turns the backends' rounding of g into a visible weight difference (seen:
# 3.6e-5 on a Mixtral step at eps 1e-8, varying with the thread count), so the steps use eps 1e-6
TRAIN = ["--lr", "1e-2", "--eps", "1e-6", "--mini-batch-size", "16", "--micro-batch-size", "2", "--use-packing"]
REPLAY = [*TRAIN, "--router-replay", "rollout"]
ODD = ["--lr", "1e-2", "--eps", "1e-6", "--mini-batch-size", "16", "--micro-batch-size", "3", "--use-packing"]
"""TRAIN with micro-batches of 3 rows: packed rows of odd lengths, which tp 2 pads with a sample of its own."""
LOSSES = [*ODD, "--moe-aux-loss-coef", "0.5", "--router-z-loss-coef", "0.1"]
ROUTER_METRICS = ("actor/moe_aux_loss", "actor/moe_router_z_loss", "actor/moe_max_expert_load")
"""The FSDP actor's router-loss metrics, logged by the megatron actor too (coefficients on or off)."""
LOSS_KEYS = ("actor/loss", "actor/pg_loss", "actor/grad_norm", *ROUTER_METRICS)


@pytest.mark.slow
@pytest.mark.parametrize("world,degrees", [(1, ["1,1"]), (2, ["2,1", "1,2", "2,2"])])
def test_logprobs_equal_transformers(world, degrees):
    """Logprobs, entropy, scoring, the gathered weights and the gradients of the megatron stages == transformers'
    at each `ep,tp` of `degrees` (one launch; tp 2: sequence parallel, the rows padded to an even length; tp 2 x ep 2
    on 2 ranks: the expert-parallel group is the tensor-parallel pair, each rank routing its half of the tokens to
    both ranks' experts)."""
    out = run_torchrun(world, WORKERS / "megatron_moe.py", *degrees, timeout=300)
    assert out.stdout.count("ok") == world


@pytest.fixture(scope="module")
def moe(tmp_path_factory, prompts_file):
    """The tiny Qwen3-MoE in the hub layout, its 'single' and 'megatron' checkpoints, and a scored batch."""
    from rlx.models.moe import write_tiny_moe_model_dir

    d = tmp_path_factory.mktemp("megatron_moe")
    hub = write_tiny_moe_model_dir(d / "hf", "qwen3_moe", seed=0, num_experts=4)
    cli_ok("shard", "--model", hub, "--out", d / "single")
    cli_ok("shard", "--model", hub, "--out", d / "mg", "--layout", "megatron")
    reward = write_length_reward(d)
    cli_ok(*rollout_args(d / "single", prompts_file, d / "r.jsonl", "--max-new-tokens", "4"))
    cli_ok("score", "--rollouts", d / "r.jsonl", "--actor", d / "single", "--reward", f"{reward}:score", "--out", d)
    write_jsonl(d / "rerouted.jsonl", [_rerouted(line, seed) for seed, line in enumerate(read_jsonl(d / "r.jsonl"))])
    cli_ok("score", "--rollouts", d / "rerouted.jsonl", "--actor", d / "single", "--reward", f"{reward}:score",
           "--out", d / "rerouted")  # fmt: skip
    return d


def _rerouted(line: dict, seed: int) -> dict:
    """A rollout line whose recorded experts are drawn at random (k distinct of 4 per token and layer): routing the
    model's own routers mostly disagree with, so replaying it changes the logprobs."""
    from rlx.models.routing import decode_routes, encode_routes

    shape = tuple(line["routed_experts_shape"])
    draws = torch.rand(*shape[:2], 4, generator=torch.Generator().manual_seed(seed)).argsort(-1)[..., : shape[2]]
    assert decode_routes(line["routed_experts"], shape).shape == draws.shape
    return {**line, "routed_experts": encode_routes(draws)}


@pytest.fixture(scope="module")
def fsdp_replayed(moe, tmp_path_factory):
    """One FSDP step in one process on the rerouted batch with train.router_replay = 'rollout' (and its metrics)."""
    out = tmp_path_factory.mktemp("fsdp_replayed")
    cli_ok("train-step", "--checkpoint", moe / "single", "--batch", moe / "rerouted" / "batch.safetensors", "--out",
           out / "ckpt", *REPLAY, "--metrics", out / "metrics.jsonl")  # fmt: skip
    return out


def check_replayed(fsdp: Path, run: Path, metrics: Path) -> None:
    """A replayed megatron step equals `fsdp`'s (the fsdp_replayed fixture): weights, loss, grad norm, the routing
    mismatch against the record and the expert load."""
    assert read_jsonl(fsdp / "metrics.jsonl")[0]["actor/moe_routing_mismatch"] > 0.3  # the record is far off
    keys = ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/moe_routing_mismatch", "moe/expert_load_max",
            "moe/expert_load_cv")  # fmt: skip
    check_equal(fsdp, run, metrics, keys)


def test_shard_and_merge_round_trip_bit_exactly(moe, tmp_path):
    """The experts and router through megatron's per-expert layout (two pipeline stages) and back to the hub's
    per-expert files: byte-identical."""
    cli_ok("shard", "--model", moe / "hf", "--out", tmp_path / "pp2", "--layout", "megatron", "--pp", "2")
    cli_ok("merge", "--checkpoint", tmp_path / "pp2", "--out", tmp_path / "back")
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (moe / "hf" / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def fsdp_losses(moe, tmp_path_factory):
    """One FSDP step in one process with the router's load-balancing and z-losses on (and its metrics)."""
    out = tmp_path_factory.mktemp("fsdp_losses")
    cli_ok("train-step", "--checkpoint", moe / "single", "--out", out / "ckpt", *LOSSES, "--batch",
           moe / "batch.safetensors", "--metrics", out / "metrics.jsonl")  # fmt: skip
    return out


def check_equal(want: Path, run: Path, metrics: Path, keys=("actor/loss", "actor/pg_loss", "actor/grad_norm")):
    """A megatron step equals a fixture's one-process FSDP step `want`: weights to 2e-5 (1.6e-5 seen on one expert's
    down_proj: Adam's first step on near-zero gradients), `keys` of the metrics line to 1e-5."""
    assert max_diff(want / "ckpt", run) < 2e-5, run
    expected, got = read_jsonl(want / "metrics.jsonl")[0], read_jsonl(metrics)[0]
    for key in keys:
        assert abs(got[key] - expected[key]) < 1e-5, (run, key, got[key], expected[key])


@pytest.fixture(scope="module")
def qwen2(moe, tmp_path_factory):
    """A tiny Qwen2-MoE (q/k/v biases, a gated shared expert, norm_topk_prob off) in the hub layout, its 'single',
    'megatron' and tp 2 checkpoints, and one FSDP step in one process with the router losses on (on the Qwen3-MoE's
    batch: the same character vocabulary and [layers, k])."""
    from rlx.models.moe import write_tiny_moe_model_dir

    d = tmp_path_factory.mktemp("megatron_qwen2_moe")
    hub = write_tiny_moe_model_dir(d / "hf", "qwen2_moe", seed=1, num_experts=4)
    for out, layout in (
        ("single", []),
        ("mg", ["--layout", "megatron"]),
        ("tp2", ["--layout", "megatron", "--tp", "2"]),
    ):
        cli_ok("shard", "--model", hub, "--out", d / out, *layout)
    cli_ok("train-step", "--checkpoint", d / "single", "--out", d / "fsdp" / "ckpt", *LOSSES, "--batch",
           moe / "batch.safetensors", "--metrics", d / "fsdp" / "metrics.jsonl")  # fmt: skip
    return d


@pytest.fixture(scope="module")
def mixtral(moe, tmp_path_factory):
    """A tiny Mixtral in the hub layout, its 'single' and 'megatron' checkpoints, and one FSDP step in one process with
    the router losses on ('fsdp') and off ('fsdp_plain'), on the Qwen3-MoE's batch."""
    from rlx.models.moe import write_tiny_moe_model_dir

    d = tmp_path_factory.mktemp("megatron_mixtral")
    hub = write_tiny_moe_model_dir(d / "hf", "mixtral", seed=2)
    cli_ok("shard", "--model", hub, "--out", d / "single")
    cli_ok("shard", "--model", hub, "--out", d / "mg", "--layout", "megatron")
    for run, args in (("fsdp", LOSSES), ("fsdp_plain", TRAIN)):
        cli_ok("train-step", "--checkpoint", d / "single", "--out", d / run / "ckpt", *args, "--batch",
               moe / "batch.safetensors", "--metrics", d / run / "metrics.jsonl")  # fmt: skip
    return d


def test_qwen2_moe_and_mixtral_shard_merge_and_train_step(moe, qwen2, mixtral, tmp_path):
    """Qwen2-MoE and Mixtral through megatron's layout at tp 2 x pp 2 (the shared expert split by tp) and back to the
    hub's files: byte-identical; a Qwen2-MoE and a Mixtral megatron step in one process with the router losses on
    equal FSDP's (weights, loss, grad norm and the router-loss metrics)."""
    hubs = {"qwen2_moe": qwen2 / "hf", "mixtral": mixtral / "hf"}
    for name, hub in hubs.items():
        cli_ok("shard", "--model", hub, "--out", tmp_path / f"{name}_mg", "--layout", "megatron", "--tp", "2", "--pp",
               "2")  # fmt: skip
        cli_ok("merge", "--checkpoint", tmp_path / f"{name}_mg", "--out", tmp_path / f"{name}_back")
        back = (tmp_path / f"{name}_back" / "model.safetensors").read_bytes()
        assert back == (hub / "model.safetensors").read_bytes(), name
    batch = ["--batch", moe / "batch.safetensors", *LOSSES]
    cli_ok("train-step", "--checkpoint", qwen2 / "mg", "--out", tmp_path / "step", *batch, "--metrics",
           tmp_path / "step.jsonl")  # fmt: skip
    check_equal(qwen2 / "fsdp", tmp_path / "step", tmp_path / "step.jsonl", LOSS_KEYS)
    cli_ok("train-step", "--checkpoint", mixtral / "mg", "--out", tmp_path / "mixtral_step", *batch, "--metrics",
           tmp_path / "mixtral_step.jsonl")  # fmt: skip
    check_equal(mixtral / "fsdp", tmp_path / "mixtral_step", tmp_path / "mixtral_step.jsonl", LOSS_KEYS)


def test_families_megatron_cannot_express_are_one_line_errors(tmp_path):
    """OLMoE (whole-projection q/k norm), a Qwen2-MoE with dense layers (decoder_sparse_step, mlp_only_layers) and a
    sliding-window Mixtral: `rlx shard --layout megatron` exits 1 naming the field, and writes nothing."""
    from rlx.models.moe import write_tiny_moe_model_dir

    cases = {
        "olmoe": (
            "olmoe",
            {},
            "not supported by the megatron backend: its q/k RMSNorm normalises the whole q and k "
            "projections, and megatron-core's qk-layernorm normalises each head; train it with the FSDP backend",
        ),
        "sparse_step": ("qwen2_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step 2: the megatron backend needs"),
        "mlp_only": ("qwen2_moe", {"mlp_only_layers": [1]}, "mlp_only_layers [1]: the megatron backend needs"),
        "sliding": ("mixtral", {"sliding_window": 16}, "sliding_window 16: the megatron backend attends"),
    }
    for name, (model_type, overrides, message) in cases.items():
        hub = write_tiny_moe_model_dir(tmp_path / name, model_type, num_hidden_layers=2, **overrides)
        result = cli("shard", "--model", hub, "--out", tmp_path / f"{name}_mg", "--layout", "megatron")
        assert result.exit_code == 1 and message in result.stderr, (name, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / f"{name}_mg").exists(), name


def test_router_losses_give_fsdp_update(moe, fsdp_losses, tmp_path):
    """--moe-aux-loss-coef and --router-z-loss-coef map onto megatron's moe_aux_loss_coeff (per layer) and rlx's
    z-loss on the megatron routers (weighted per micro-batch as the FSDP path weights them): the same update in one
    process, and the same actor/moe_aux_loss, actor/moe_router_z_loss and actor/moe_max_expert_load."""
    cli_ok("train-step", "--checkpoint", moe / "mg", "--out", tmp_path / "mg", *LOSSES, "--batch",
           moe / "batch.safetensors", "--metrics", tmp_path / "mg.jsonl")  # fmt: skip
    cli_ok("train-step", "--checkpoint", moe / "mg", "--out", tmp_path / "plain", *ODD, "--batch",
           moe / "batch.safetensors")  # fmt: skip
    check_equal(fsdp_losses, tmp_path / "mg", tmp_path / "mg.jsonl", LOSS_KEYS)  # 1.1e-5 seen (Adam's first step)
    assert max_diff(tmp_path / "plain", tmp_path / "mg") > 1e-3  # the losses do move the weights


def test_score_equals_the_hf_path(moe, tmp_path):
    """`rlx score` on the megatron checkpoint gives the Hugging Face path's logprobs, advantages and routing mismatch;
    with --router-replay rollout on rollouts whose recorded experts the routers disagree with, both force them alike
    (logprobs equal, unlike the unforced ones)."""
    from rlx.formats.batch import TrainBatch

    args = ["--rollouts", moe / "r.jsonl", "--reward", f"{moe / 'length_reward.py'}:score"]
    cli_ok("score", *args, "--actor", moe / "mg", "--ref", moe / "mg", "--out", tmp_path / "mg")
    cli_ok("score", *args, "--actor", moe / "single", "--ref", moe / "single", "--out", tmp_path / "hf")
    args[1] = moe / "rerouted.jsonl"
    for actor in ("mg", "single"):
        cli_ok("score", *args, "--actor", moe / actor, "--out", tmp_path / f"{actor}_replay", "--router-replay",
               "rollout")  # fmt: skip
    pairs = {"hf": "mg", "single_replay": "mg_replay"}
    for hf, mg in pairs.items():
        want, got = (TrainBatch.load(tmp_path / run / "batch.safetensors") for run in (hf, mg))
        for key in ("old_logprobs", "advantages", *(("ref_logprobs",) if hf == "hf" else ())):
            assert (getattr(want, key) - getattr(got, key)).abs().max().item() < 1e-5, (mg, key)
        assert torch.equal(want.routed_experts, got.routed_experts)
        assert abs(want.meta.routing_mismatch - got.meta.routing_mismatch) < 1e-9, mg
    replayed, own = (TrainBatch.load(d / "batch.safetensors") for d in (tmp_path / "mg_replay", moe / "rerouted"))
    assert replayed.meta.routing_mismatch > 0.3 and (replayed.old_logprobs - own.old_logprobs).abs().max() > 1e-3


def test_router_replay_train_step_equals_fsdp(moe, fsdp_replayed, tmp_path):
    """train.router_replay = 'rollout' on the megatron stages (one process) forces the recorded experts as the FSDP
    path does: the same update, loss, routing mismatch and expert load; without replay the loss differs."""
    batch = moe / "rerouted" / "batch.safetensors"
    cli_ok("train-step", "--checkpoint", moe / "mg", "--batch", batch, "--out", tmp_path / "mg", *REPLAY, "--metrics",
           tmp_path / "mg.jsonl")  # fmt: skip
    check_replayed(fsdp_replayed, tmp_path / "mg", tmp_path / "mg.jsonl")
    cli_ok("train-step", "--checkpoint", moe / "mg", "--batch", batch, "--out", tmp_path / "own", *TRAIN, "--metrics",
           tmp_path / "own.jsonl")  # fmt: skip
    own, replayed = read_jsonl(tmp_path / "own.jsonl")[0], read_jsonl(tmp_path / "mg.jsonl")[0]
    assert max_diff(tmp_path / "own", tmp_path / "mg") > 1e-3
    assert own["actor/ppo_kl"] < 1e-6 < 1e-5 < replayed["actor/ppo_kl"]  # the batch's old logprobs are unreplayed
    assert own["actor/moe_routing_mismatch"] == replayed["actor/moe_routing_mismatch"]  # compared before forcing


def test_unsupported_settings_are_one_line_errors(moe, tmp_path):
    batch = moe / "batch.safetensors"
    result = cli(
        "train-step", "--checkpoint", moe / "mg", "--batch", batch, "--out", tmp_path / "x", "--ep-degree", "2"
    )
    assert result.exit_code == 1 and "ep_degree 2 must divide the 1 tensor x data parallel process(es)" in result.stderr
    assert not (tmp_path / "x").exists()
    # routing replay: a batch without recorded experts, or with another model's [layers, k]
    from rlx.formats.batch import TrainBatch

    full = TrainBatch.load(batch)
    dataclasses.replace(full, routed_experts=None).save(tmp_path / "unrouted.safetensors")
    dataclasses.replace(full, routed_experts=full.routed_experts[:, :, :1]).save(tmp_path / "one_layer.safetensors")
    for name, message in (
        ("unrouted", "router_replay = 'rollout' needs a batch with routed_experts"),
        ("one_layer", "routed_experts are [layers, k] = [1, 2], but the model has 2 MoE layers"),
    ):
        result = cli("train-step", "--checkpoint", moe / "mg", "--batch", tmp_path / f"{name}.safetensors", "--out",
                     tmp_path / name, *REPLAY)  # fmt: skip
        assert result.exit_code == 1 and message in result.stderr, (name, result.stderr)
        assert not (tmp_path / name).exists()


def test_moe_compat_layer_targets_the_upstream_code():
    """The megatron-core MoE code the CPU shims stand in for still has the CUDA-only lines they cover."""
    import inspect

    from megatron.core import utils
    from megatron.core.tensor_parallel import layers, mappings, random
    from megatron.core.transformer.moe import moe_utils, router, token_dispatcher

    from rlx.models.megatron import compat

    compat.moe_apply()
    assert "torch.cuda.current_device()" in inspect.getsource(router.Router.gating)
    assert "torch.cuda.Stream()" in inspect.getsource(token_dispatcher.MoEAlltoAllTokenDispatcher.__init__)
    assert "torch.cuda.current_device()" in inspect.getsource(mappings._gather_along_first_dim)
    assert "tensor.is_cuda" in inspect.getsource(compat.ORIGINALS["maybe_move_tensor_to_cpu"])
    assert "te_general_gemm is not None" in inspect.getsource(moe_utils.RouterGatingLinearFunction.forward)
    # sequence parallelism (tp > 1): the linear layers' all-gather buffer and reduce-scatter output, the RNG fork
    assert "torch.cuda.current_device()" in inspect.getsource(utils.GlobalMemoryBuffer.get_tensor)
    assert "torch.cuda.current_device()" in inspect.getsource(layers.LinearWithGradAccumulationAndAsyncCommunication)
    assert "raise Exception" in inspect.getsource(random.CudaRNGStatesTracker.fork)
    with random.get_cuda_rng_tracker().fork():  # the inference tracker's: nothing seeded, nothing to fork
        pass
    # routing replay and the padding mask (rlx/models/megatron/routing.py, schedule.py): the router asks its
    # `router_replay` object for every top-k, and megatron's padding mask is True on padding
    assert "router_replay=self.router_replay" in inspect.getsource(router.TopKRouter.routing)
    assert "router_replay.get_replay_topk(" in inspect.getsource(moe_utils.topk_routing_with_score_function)
    assert "valid_mask = (~padding_mask)" in inspect.getsource(moe_utils.compute_routing_scores_for_aux_loss)
    if not torch.cuda.is_available():
        assert router.torch.cuda.current_device() == torch.device("cpu")


def ppo_args(prompts_file, *extra: str) -> list[str]:
    """`--set` flags of 2 small steps of the MoE quickstart (router losses off: each data-parallel rank would compute
    them over its own tokens), plus `extra` settings."""
    sets = [
        f"data.prompts={prompts_file}", "data.prompts_per_step=4", "rollout.sampling.n=4", "train.mini_batch_size=8",
        "train.micro_batch_size=4", "score.micro_batch_size=8", "train.use_packing=true", "steps=2", "save_every=2",
        "train.loss.moe_aux_loss_coef=0", *extra,
    ]  # fmt: skip
    return [a for s in sets for a in ("--set", s)]


@pytest.mark.slow
def test_ppo_with_megatron_expert_and_tensor_parallelism_equals_one_process(tmp_path, prompts_file):
    """`rlx ppo` of the MoE quickstart with [megatron] on 2 ranks, at train.ep_degree = 2 and at megatron.tp_degree =
    2 (reference stages, scoring and the rollout replica's weight sync under EP, or TP with sequence parallelism), with
    routing replay in scoring and training, == the one-process FSDP run (router losses off: at ep 2 the two
    data-parallel ranks compute them over their own tokens)."""
    from rlx.models.moe import write_tiny_moe_config_dir

    model = write_tiny_moe_config_dir(tmp_path / "tiny-moe")
    args = ppo_args(prompts_file, f"model.path={model}", "score.router_replay=rollout", "train.router_replay=rollout")
    recipe = REPO / "recipes" / "moe_quickstart.toml"
    cli_ok("ppo", recipe, "--out", tmp_path / "one", *args)
    runs = {"ep2": "train.ep_degree=2", "tp2": "megatron.tp_degree=2"}
    for run, degree in runs.items():
        torchrun(2, "ppo", recipe, "--out", tmp_path / run, *args, "--set", "megatron.pp_degree=1", "--set", degree)
    final = "checkpoints/step_000002"
    one = read_jsonl(tmp_path / "one" / "metrics.jsonl")
    assert one[0]["actor/grad_norm"] > 0
    for run in runs:
        meta = json.loads((tmp_path / run / final / "rlx.json").read_text())
        assert meta["layout"] == "megatron" and meta["tp_degree"] == (2 if run == "tp2" else 1)
        assert max_diff(tmp_path / "one" / final, tmp_path / run / final) < 1e-5, run
        two = read_jsonl(tmp_path / run / "metrics.jsonl")
        keys = ("reward/mean", "actor/loss", "actor/grad_norm", "moe/routing_mismatch", "actor/moe_routing_mismatch",
                "moe/expert_load_max", "moe/expert_load_cv")  # fmt: skip
        for key in keys:
            assert all(abs(a[key] - b[key]) < 1e-5 for a, b in zip(one, two)), (run, key)


@pytest.mark.slow
@pytest.mark.parametrize("family, degree", [("qwen2_moe", "megatron.tp_degree=2"), ("mixtral", "train.ep_degree=2")])
def test_ppo_of_qwen2_moe_and_mixtral_on_megatron_equals_one_process(tmp_path, prompts_file, family, degree):
    """`rlx ppo` of the MoE quickstart's work on a tiny Qwen2-MoE (gated shared expert, q/k/v biases) at tp 2 and a
    tiny Mixtral at ep 2 with [megatron] on 2 ranks, routing replay in scoring and training, == the one-process FSDP
    run: weights after 2 steps and the step metrics (router losses off: each data-parallel rank would compute them
    over its own tokens)."""
    from rlx.models.moe import write_tiny_moe_config_dir

    model = write_tiny_moe_config_dir(tmp_path / family, family)
    args = ppo_args(prompts_file, f"model.path={model}", "score.router_replay=rollout", "train.router_replay=rollout")
    recipe = REPO / "recipes" / "moe_quickstart.toml"
    cli_ok("ppo", recipe, "--out", tmp_path / "one", *args)
    torchrun(2, "ppo", recipe, "--out", tmp_path / "two", *args, "--set", "megatron.pp_degree=1", "--set", degree)
    final = "checkpoints/step_000002"
    assert json.loads((tmp_path / "two" / final / "rlx.json").read_text())["layout"] == "megatron"
    assert max_diff(tmp_path / "one" / final, tmp_path / "two" / final) < 1e-5
    one, two = (read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("one", "two"))
    assert one[0]["actor/grad_norm"] > 0
    for key in ("reward/mean", "actor/loss", "actor/grad_norm", "moe/routing_mismatch", "moe/expert_load_max"):
        assert all(abs(a[key] - b[key]) < 1e-5 for a, b in zip(one, two)), key


@pytest.mark.slow
def test_ppo_with_an_moe_critic_on_megatron_equals_one_process(tmp_path, prompts_file):
    """GAE with a critic built from the tiny Qwen3-MoE's backbone: `rlx ppo` with [megatron] at train.ep_degree = 2
    on 2 ranks == the one-process FSDP run, actor and critic weights after 2 steps and the critic's metrics."""
    from rlx.models.moe import write_tiny_moe_config_dir

    model = write_tiny_moe_config_dir(tmp_path / "tiny-moe")
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(
        (REPO / "recipes" / "moe_quickstart.toml").read_text().replace('path = "tiny-moe-arith"', f'path = "{model}"')
        + "\n[critic]\n\n[critic.train]\nmini_batch_size = 8\nmicro_batch_size = 4\n"
        + "\n[critic.train.optim]\nlr = 1e-3\nweight_decay = 0.0\n"
    )
    args = ppo_args(prompts_file, "score.estimator=gae")
    cli_ok("ppo", recipe, "--out", tmp_path / "one", *args)
    torchrun(2, "ppo", recipe, "--out", tmp_path / "two", *args, "--set", "megatron.pp_degree=1", "--set",
             "train.ep_degree=2")  # fmt: skip
    final = tmp_path / "{}" / "checkpoints" / "step_000002"
    one, two = (Path(str(final).format(run)) for run in ("one", "two"))
    assert json.loads((two / "critic" / "rlx.json").read_text())["layout"] == "megatron"
    assert max_diff(one, two) < 1e-5
    assert max_diff(one / "critic", two / "critic") < 1e-5
    a, b = (read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("one", "two"))
    assert a[0]["critic/grad_norm"] > 0
    for key in ("actor/loss", "critic/vf_loss", "critic/grad_norm", "critic/values_mean"):
        assert all(abs(x[key] - y[key]) < 1e-5 for x, y in zip(a, b)), key


@pytest.mark.slow
def test_two_rank_train_steps_equal_one_process(moe, fsdp_losses, qwen2, mixtral, tmp_path):
    """In one launch of 2 ranks: megatron at ep 2 (the experts split) == megatron in one process == FSDP in one process
    == FSDP's expert parallelism (loss and weights after the step, 1e-5); the checkpoint holds every expert and the
    next step from it at ep 1 equals the one from the ep 1 checkpoint at ep 2 (and FSDP's); tp 2 (sequence parallel:
    each rank routes half of the tokens through whole experts) == FSDP; and tp 2 with the router losses on (the
    padding sample left out of them) == FSDP's one process with them, as does a Qwen2-MoE at tp 2 (its shared expert
    split by tp, its gate's gradient summed over the tp ranks); a Mixtral at ep 2 == FSDP's one process; the
    router-loss metrics equal FSDP's in every run."""
    batch, common = ["--batch", moe / "batch.safetensors"], [*TRAIN, "--metrics"]
    cli_ok("shard", "--model", moe / "hf", "--out", tmp_path / "tp2", "--layout", "megatron", "--tp", "2")
    for layout, run in (("single", "fsdp1"), ("mg", "mg1")):
        cli_ok("train-step", "--checkpoint", moe / layout, *batch, "--out", tmp_path / run, *common,
               tmp_path / f"{run}.jsonl")  # fmt: skip
    ep2 = ["--ep-degree", "2"]
    torchrun_commands(
        2,
        ["train-step", "--checkpoint", moe / "mg", *batch, "--out", tmp_path / "mg2", *common, tmp_path / "mg2.jsonl",
         *ep2],
        ["train-step", "--checkpoint", moe / "single", *batch, "--out", tmp_path / "fsdp2", *common,
         tmp_path / "fsdp2.jsonl", *ep2],
        ["train-step", "--checkpoint", tmp_path / "mg1", *batch, "--out", tmp_path / "mg1_2", *TRAIN, *ep2],
        ["train-step", "--checkpoint", tmp_path / "tp2", *batch, "--out", tmp_path / "tp2_1", *common,
         tmp_path / "tp2_1.jsonl"],
        ["train-step", "--checkpoint", tmp_path / "tp2", *batch, "--out", tmp_path / "tp2_losses", *LOSSES,
         "--metrics", tmp_path / "tp2_losses.jsonl"],
        ["train-step", "--checkpoint", qwen2 / "tp2", *batch, "--out", tmp_path / "qwen2_tp2", *LOSSES, "--metrics",
         tmp_path / "qwen2_tp2.jsonl"],
        ["train-step", "--checkpoint", mixtral / "mg", *batch, "--out", tmp_path / "mixtral_ep2", *common,
         tmp_path / "mixtral_ep2.jsonl", *ep2],
    )  # fmt: skip
    meta = json.loads((tmp_path / "mg2" / "rlx.json").read_text())
    assert (meta["layout"], meta["tp_degree"], meta["pp_degree"]) == ("megatron", 1, 1)
    want = read_jsonl(tmp_path / "fsdp1.jsonl")[0]
    for run, tolerance in (("mg1", 1e-5), ("mg2", 1e-5), ("fsdp2", 1e-5), ("tp2_1", 2e-5)):
        assert max_diff(tmp_path / "fsdp1", tmp_path / run) < tolerance, run
        got = read_jsonl(tmp_path / f"{run}.jsonl")[0]
        for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "moe/expert_load_max", "moe/expert_load_cv"):
            assert abs(got[key] - want[key]) < 1e-5, (run, key, got[key], want[key])
    # the router-loss metrics are per micro-batch: at dp 2 (ep 2) each rank's rows make its own micro-batches, so
    # megatron's equal FSDP's at 2 ranks; at tp 2 (one data-parallel rank) one process's
    for run, want in (("mg1", "fsdp1"), ("tp2_1", "fsdp1"), ("mg2", "fsdp2")):
        got, want = (read_jsonl(tmp_path / f"{name}.jsonl")[0] for name in (run, want))
        for key in ROUTER_METRICS:
            assert abs(got[key] - want[key]) < 1e-5, (run, key, got[key], want[key])
    check_equal(fsdp_losses, tmp_path / "tp2_losses", tmp_path / "tp2_losses.jsonl", LOSS_KEYS)
    check_equal(qwen2 / "fsdp", tmp_path / "qwen2_tp2", tmp_path / "qwen2_tp2.jsonl", LOSS_KEYS)
    check_equal(mixtral / "fsdp_plain", tmp_path / "mixtral_ep2", tmp_path / "mixtral_ep2.jsonl")
    before, after = read_full_weights(moe / "mg"), read_full_weights(tmp_path / "mg2")
    key = "model.layers.1.mlp.experts.down_proj"
    assert after[key].shape == before[key].shape and not torch.equal(after[key][-1], before[key][-1])
    # the next step resumes the AdamW state (experts keyed by global index) at the other ep_degree
    cli_ok("train-step", "--checkpoint", tmp_path / "mg2", *batch, "--out", tmp_path / "mg2_1", *TRAIN)
    cli_ok("train-step", "--checkpoint", tmp_path / "fsdp1", *batch, "--out", tmp_path / "fsdp1_1", *TRAIN)
    assert max_diff(tmp_path / "mg2_1", tmp_path / "mg1_2") < 1e-5
    assert max_diff(tmp_path / "fsdp1_1", tmp_path / "mg1_2") < 1e-5


@pytest.mark.slow
def test_four_rank_train_steps_equal_one_process(moe, fsdp_replayed, fsdp_losses, tmp_path):
    """In one launch of 4 ranks, against one FSDP process: pp 2 x ep 2 (each stage's experts split over 2
    data-parallel ranks) and tp 2 x ep 2 (sequence parallel, each rank's slice of the row) with routing replay on a
    batch whose recorded experts differ from the routers' own (update, loss, routing mismatch and expert load equal
    the FSDP replay's); pp 2 x tp 2 (half of the padded row crossing between the stages on each tensor-parallel rank)
    with the router losses on (each stage's routers weighted at its own backward, the padding left out); `rlx score`
    with replay at tp 2 x dp 2 equals the Hugging Face path's. `rlx merge` of the tp 2 x ep 2 checkpoint gives the
    same weights."""
    rerouted = ["--batch", moe / "rerouted" / "batch.safetensors"]
    for tp, pp in ((2, 1), (1, 2), (2, 2)):
        cli_ok("shard", "--model", moe / "hf", "--out", tmp_path / f"tp{tp}pp{pp}", "--layout", "megatron", "--tp",
               str(tp), "--pp", str(pp))  # fmt: skip
    score = ["score", "--rollouts", moe / "rerouted.jsonl", "--reward", f"{moe / 'length_reward.py'}:score",
             "--router-replay", "rollout"]  # fmt: skip
    cli_ok(*score, "--actor", moe / "single", "--out", tmp_path / "hf_score")
    torchrun_commands(
        4,
        ["train-step", "--checkpoint", tmp_path / "tp1pp2", *rerouted, "--out", tmp_path / "pp2ep2", *REPLAY,
         "--ep-degree", "2", "--metrics", tmp_path / "pp2ep2.jsonl"],
        ["train-step", "--checkpoint", tmp_path / "tp2pp1", *rerouted, "--out", tmp_path / "tp2ep2", *REPLAY,
         "--ep-degree", "2", "--metrics", tmp_path / "tp2ep2.jsonl"],
        ["train-step", "--checkpoint", tmp_path / "tp2pp2", "--batch", moe / "batch.safetensors", "--out",
         tmp_path / "pp2tp2", *LOSSES, "--metrics", tmp_path / "pp2tp2.jsonl"],
        [*score, "--actor", tmp_path / "tp2pp1", "--out", tmp_path / "mg_score"],
    )  # fmt: skip
    for run in ("pp2ep2", "tp2ep2"):
        check_replayed(fsdp_replayed, tmp_path / run, tmp_path / f"{run}.jsonl")
    check_equal(fsdp_losses, tmp_path / "pp2tp2", tmp_path / "pp2tp2.jsonl", LOSS_KEYS)
    meta = json.loads((tmp_path / "tp2ep2" / "rlx.json").read_text())
    assert (meta["layout"], meta["tp_degree"], meta["pp_degree"]) == ("megatron", 2, 1)
    cli_ok("merge", "--checkpoint", tmp_path / "tp2ep2", "--out", tmp_path / "merged")
    assert max_diff(tmp_path / "tp2ep2", tmp_path / "merged") == 0
    from rlx.formats.batch import TrainBatch

    want, got = (TrainBatch.load(tmp_path / run / "batch.safetensors") for run in ("hf_score", "mg_score"))
    assert (want.old_logprobs - got.old_logprobs).abs().max().item() < 1e-5
    assert want.meta.routing_mismatch > 0.3 and abs(want.meta.routing_mismatch - got.meta.routing_mismatch) < 1e-9
