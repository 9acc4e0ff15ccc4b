"""`deterministic = true` (rlx/utils/determinism.py): the run turns on torch's deterministic kernels before its first
matmul and trains the same weights as without them where the kernels already were deterministic (the CPU); an op
with no deterministic kernel stops the run with a message naming the key."""

from __future__ import annotations

import os

import pytest
import torch

from rlx.utils.determinism import CUBLAS_WORKSPACE, determinism_error
from tests.conftest import REPO, cli
from tests.stages.test_ppo import assert_same_weights

QUICKSTART = REPO / "recipes" / "quickstart.toml"
TINY = ["--set", "data.prompts_per_step=4", "--set", "rollout.sampling.n=2", "--set", "steps=2"]
# torch's own wording for an op without a deterministic kernel (at::globalContext().alertNotDeterministic); no CPU
# op raises it, so the tests raise it themselves
TORCH_ALERT = (
    "index_add_cuda_ does not have a deterministic implementation, but you set 'torch.use_deterministic_algorithms"
    "(True)'. You can turn off determinism just for this operation, or you can use the 'warn_only=True' option"
)


@pytest.fixture
def restore_determinism(monkeypatch):
    """The run sets process-wide flags; put them back for the tests after this one."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)  # fmt: skip
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


def test_a_deterministic_run_turns_the_kernels_on_and_trains_the_same_weights(tmp_path, restore_determinism):
    plain = cli("ppo", QUICKSTART, "--out", tmp_path / "plain", *TINY)
    assert plain.exit_code == 0, plain.stderr[-2000:]
    assert not torch.are_deterministic_algorithms_enabled()
    seen = {}
    from rlx.training.actor import ActorTrainer

    step = ActorTrainer.train_step

    def watched(self, *args, **kwargs):
        seen["deterministic"] = torch.are_deterministic_algorithms_enabled()
        seen["cublas"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        return step(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ActorTrainer, "train_step", watched)
        run = cli("ppo", QUICKSTART, "--out", tmp_path / "det", *TINY, "--set", "deterministic=true")
    assert run.exit_code == 0, run.stderr[-2000:]
    assert seen == {"deterministic": True, "cublas": CUBLAS_WORKSPACE}
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    last = "checkpoints/step_000002"
    assert_same_weights(tmp_path / "plain" / last, tmp_path / "det" / last)


def test_an_op_without_a_deterministic_kernel_is_named(tmp_path, restore_determinism, monkeypatch):
    from rlx.training.actor import ActorTrainer

    def alert(self, *args, **kwargs):
        raise RuntimeError(TORCH_ALERT)

    monkeypatch.setattr(ActorTrainer, "train_step", alert)
    run = cli("ppo", QUICKSTART, "--out", tmp_path / "det", *TINY, "--set", "deterministic=true")
    assert run.exit_code == 1
    assert "deterministic = true: index_add_cuda_ has no deterministic kernel on this device" in run.stderr
    # without the key the same error is not blamed on it
    assert determinism_error(RuntimeError("CUDA error: out of memory")) is None
    assert determinism_error(ValueError(TORCH_ALERT)) is None
