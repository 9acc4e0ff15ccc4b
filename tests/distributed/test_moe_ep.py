"""Expert parallelism for MoE training (gloo, CPU): a train step with the experts split over 2 (and 4) ranks equals
one process's, weights and loss; checkpoints written with EP on hold the full fused experts and merge to the same
hub layout; bad degrees are refused with one line."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from rlx.checkpoints.registry import read_full_weights
from tests.conftest import (
    cli,
    cli_ok,
    max_diff,
    read_jsonl,
    rollout_args,
    run_torchrun,
    torchrun,
    torchrun_commands,
    write_length_reward,
)

# packed rows: every routed token is a real one, so the expert load does not depend on how rows are split
TRAIN = ["--lr", "1e-2", "--mini-batch-size", "8", "--micro-batch-size", "2", "--use-packing"]


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    from rlx.models.moe import write_tiny_moe_model_dir

    d = tmp_path_factory.mktemp("moe_ep")
    hub = write_tiny_moe_model_dir(d / "hf", "qwen3_moe", seed=0, num_experts=4)
    cli_ok("shard", "--model", hub, "--out", d / "step0")
    return d / "step0"


@pytest.fixture(scope="module")
def moe_batch(moe_ckpt, prompts_file, tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_ep_batch")
    reward = write_length_reward(d)
    cli_ok(*rollout_args(moe_ckpt, prompts_file, d / "r.jsonl", "--max-new-tokens", "4"))
    cli_ok("score", "--rollouts", d / "r.jsonl", "--actor", moe_ckpt, "--reward", f"{reward}:score", "--out", d)
    return d / "batch.safetensors"


@pytest.fixture(scope="module")
def single(moe_ckpt, moe_batch, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_ep_single")
    cli_ok("train-step", "--checkpoint", moe_ckpt, "--batch", moe_batch, "--out", out / "c", *TRAIN,
           "--metrics", out / "m.jsonl")  # fmt: skip
    return out


def assert_equals_single(ckpt, metrics: dict, single, moe_ckpt) -> None:
    """An EP train step's checkpoint and metrics equal the one-process step's (`single`), the experts held whole."""
    want = read_jsonl(single / "m.jsonl")[0]
    assert max_diff(single / "c", ckpt) < 1e-5
    keys = ("actor/loss", "actor/pg_loss", "actor/grad_norm", "moe/expert_load_max", "moe/expert_load_cv")
    for key in keys:
        assert abs(metrics[key] - want[key]) < 1e-5, (key, metrics[key], want[key])
    before, after = read_full_weights(moe_ckpt), read_full_weights(ckpt)
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert after[key].shape == before[key].shape  # the full [E, 2I, H], not one rank's experts
    assert not torch.equal(before[key][-1], after[key][-1])  # the last rank's experts trained too


def test_ep2_equals_one_process(tmp_path, moe_ckpt, moe_batch, single):
    """4 ranks: two EP groups, each expert FSDP-sharded over the 2 ranks holding it (and the layers recomputed in
    the backward, all-to-all included). One EP group of 2 ranks: test_ep_checkpoint_round_trips_to_the_hub_layout."""
    torchrun(4, "train-step", "--checkpoint", moe_ckpt, "--batch", moe_batch, "--out", tmp_path / "c", *TRAIN,
             "--ep-degree", "2", "--metrics", tmp_path / "m.jsonl", "--gradient-checkpointing")  # fmt: skip
    assert_equals_single(tmp_path / "c", read_jsonl(tmp_path / "m.jsonl")[0], single, moe_ckpt)


def test_ep_checkpoint_round_trips_to_the_hub_layout(tmp_path, moe_ckpt, moe_batch, single):
    """An EP run on 2 ranks (one EP group) writing the 'fsdp' layout (DCP shards) equals one process; `rlx merge`
    gives the per-expert hub layout, which shards back to the checkpoint's full fused weights bit for bit; the
    checkpoint trains on under EP (optimizer state resharded onto the expert mesh)."""
    cli_ok("shard", "--model", moe_ckpt, "--out", tmp_path / "dcp0", "--layout", "fsdp")
    # both EP steps in one launch of 2 processes; the second starts from the first's checkpoint (nothing else carries
    # state from one command to the next)
    torchrun_commands(
        2,
        ["train-step", "--checkpoint", tmp_path / "dcp0", "--batch", moe_batch, "--out", tmp_path / "dcp1", *TRAIN,
         "--ep-degree", "2", "--metrics", tmp_path / "m.jsonl"],
        ["train-step", "--checkpoint", tmp_path / "dcp1", "--batch", moe_batch, "--out", tmp_path / "dcp2", *TRAIN,
         "--ep-degree", "2"],
    )  # fmt: skip
    assert_equals_single(tmp_path / "dcp1", read_jsonl(tmp_path / "m.jsonl")[0], single, moe_ckpt)
    cli_ok("merge", "--checkpoint", tmp_path / "dcp1", "--out", tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in set(f.keys())
    cli_ok("shard", "--model", tmp_path / "hf", "--out", tmp_path / "back")
    trained, back = read_full_weights(tmp_path / "dcp1"), read_full_weights(tmp_path / "back")
    assert trained.keys() == back.keys() and all(torch.equal(trained[k], back[k]) for k in trained)
    assert not torch.equal(trained["model.layers.0.mlp.experts.down_proj"],
                           read_full_weights(moe_ckpt)["model.layers.0.mlp.experts.down_proj"])  # fmt: skip
    assert max_diff(tmp_path / "dcp1", tmp_path / "dcp2") > 0


def test_bad_ep_degree_is_one_line(tmp_path, moe_ckpt, moe_batch):
    out = run_torchrun(2, "-m", "rlx", "train-step", "--checkpoint", moe_ckpt, "--batch", moe_batch, "--out",
                       tmp_path / "c", "--ep-degree", "3", check=False)  # fmt: skip
    assert out.returncode == 1 and "ep_degree 3 must divide the number of processes (2" in out.stderr, out.stderr[-800:]
    result = cli("train-step", "--checkpoint", moe_ckpt, "--batch", moe_batch, "--out", tmp_path / "d",
                 "--ep-degree", "2")  # fmt: skip
    assert result.exit_code == 1 and "ep_degree 2 must divide the number of processes (1" in result.stderr, result


def test_router_z_loss_changes_the_update_only_when_on(tmp_path, moe_ckpt, moe_batch, single):
    """The z-loss and expert-load metrics are logged with the z-loss off (the `single` step) and on; only with it
    on does the update shrink the router logits' log-sum-exp (the second mini-batch's z-loss is lower) and the
    routers move differently."""
    cli_ok("train-step", "--checkpoint", moe_ckpt, "--batch", moe_batch, "--out", tmp_path / "c", *TRAIN,
           "--router-z-loss-coef", "1.0", "--metrics", tmp_path / "m.jsonl")  # fmt: skip
    off, on = read_jsonl(single / "m.jsonl")[0], read_jsonl(tmp_path / "m.jsonl")[0]
    assert 0 < on["actor/moe_router_z_loss"] < off["actor/moe_router_z_loss"]
    assert off["actor/loss"] == off["actor/pg_loss"]  # nothing added while off
    assert off["moe/expert_load_max"] >= 1.0 and off["moe/expert_load_cv"] >= 0
    before, plain, with_z = (read_full_weights(p) for p in (moe_ckpt, single / "c", tmp_path / "c"))
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(plain[gate], with_z[gate]) and not torch.equal(before[gate], with_z[gate])


def test_ep_forward_equals_transformers_experts(tmp_path):
    """The EP forward over a one-rank group (the dispatch, the local experts' grouped GEMMs, the combine) equals
    transformers' experts forward, outputs and gradients, and gives zero gradients when no token comes; an experts
    module left unsplit falls back to transformers' own forward."""
    import torch.distributed as dist

    from rlx.kernels.grouped_experts import grouped_mm_trains
    from rlx.models.moe import MOE_FAMILIES, tiny_moe_config
    from rlx.models.tiny import build_char_tokenizer
    from rlx.parallel.experts import ExpertShard, expert_parallel_forward

    owned = not dist.is_initialized()  # an in-process megatron stage of this worker may have left its lone group
    if owned:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_moe_config(len(build_char_tokenizer()), num_experts=4))
        experts = MOE_FAMILIES["qwen3_moe"].expert_modules(model)[0]
        hidden = torch.randn(7, 32, requires_grad=True)
        top_k_index, top_k_weights = torch.randint(0, 4, (7, 2)), torch.rand(7, 2)
        want = experts(hidden, top_k_index, top_k_weights)
        (want_grad,) = torch.autograd.grad(want.square().sum(), experts.down_proj)
        assert torch.allclose(expert_parallel_forward(experts, hidden, top_k_index, top_k_weights), want, atol=1e-6)
        if hasattr(torch.nn.functional, "grouped_mm"):  # the tiny experts' rows fit grouped_mm: the EP tests run it
            assert grouped_mm_trains(hidden.device, torch.float32, experts.gate_up_proj, experts.down_proj)
        experts.expert_shard = ExpertShard(dist.group.WORLD, 1, 0, 4)
        got = expert_parallel_forward(experts, hidden, top_k_index, top_k_weights)
        (got_grad,) = torch.autograd.grad(got.square().sum(), experts.down_proj)
        assert torch.allclose(got, want, atol=1e-6) and torch.allclose(got_grad, want_grad, atol=1e-6)
        # a rank no token was sent to still gets (zero) gradients: FSDP's reduce-scatter over its peers lines up
        empty = expert_parallel_forward(experts, hidden[:0], top_k_index[:0], top_k_weights[:0])
        (idle_grad,) = torch.autograd.grad(empty.sum(), experts.down_proj)
        assert empty.shape == (0, 32) and idle_grad.shape == (4, 32, 16) and not idle_grad.any()
    finally:
        if owned:
            dist.destroy_process_group()
