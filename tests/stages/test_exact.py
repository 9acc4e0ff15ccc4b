"""Exact (batch-invariant) mode: the native engine's logprobs equal the trainer's, bit for bit, whatever the batch.

One probe sequence is generated at batch sizes 1, 3 and 17 (at different positions, some batches sharing its
prompt's cached blocks) and scored by the training forward in padded and packed micro-batches of 1, 3 and 17
rows: with exact mode every logprob is torch.equal; without it some differ (so the test can fail).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random

import pytest
import torch

from rlx.kernels.exact import ROW_BLOCK, blocked_linear, log_softmax, target_logprobs, tree_sum
from rlx.logprobs import packed_response_logprobs, response_logprobs
from rlx.models.attention import enable_packed_attention
from rlx.models.exact import exact_forward
from rlx.models.tiny import build_char_tokenizer, tiny_llama_config
from rlx.rollout.config import NativeConfig, RolloutConfig, SamplingParams
from rlx.rollout.requests import Generated, TokenRequest
from tests.conftest import cli, cli_ok, make_engine, read_jsonl, write_length_reward

NEW_TOKENS = 6
PROBE = [1, 7, 5, 9, 4, 12, 6, 8, 10, 5]  # prompt token ids (vocabulary of the character tokenizer)


def test_blocked_gemm_rows_do_not_depend_on_their_neighbours():
    """The premise of blocked_linear: a row's output does not depend on its position in a fixed-shape call, or on
    the other rows; and plain F.linear does depend on the row count here (what exact mode avoids)."""
    torch.manual_seed(0)
    weight, row = torch.randn(300, 128), torch.randn(1, 128)
    ref = blocked_linear(row, weight)
    for count, at in ((3, 1), (17, 9), (ROW_BLOCK + 5, ROW_BLOCK + 2), (130, 100)):
        rows = torch.randn(count, 128)
        rows[at] = row[0]
        assert torch.equal(blocked_linear(rows, weight)[at], ref[0]), (count, at)
    plain = [torch.nn.functional.linear(torch.cat([row, torch.randn(n - 1, 128)]), weight)[0] for n in (1, 3, 64)]
    assert not all(torch.equal(plain[0], p) for p in plain[1:])
    x = torch.randn(5, 37)
    torch.testing.assert_close(tree_sum(x, -1), x.sum(-1))
    torch.testing.assert_close(log_softmax(x), torch.log_softmax(x, -1))
    logits, targets = torch.randn(3, 2000, 37, requires_grad=True), torch.randint(0, 37, (3, 2000))
    picked, entropy = target_logprobs(logits, targets, 0.7, with_entropy=True)  # chunked, recomputed in backward
    (picked.sum() + entropy.sum()).backward()
    leaf = logits.detach().clone().requires_grad_()
    plain = torch.log_softmax(leaf / 0.7, -1)
    expected = plain.gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(picked, expected)
    (expected.sum() - (plain.exp() * plain).sum()).backward()
    torch.testing.assert_close(logits.grad, leaf.grad)


@pytest.fixture(scope="module")
def model():
    config = tiny_llama_config(len(build_char_tokenizer()), hidden_size=128, num_heads=4, num_kv_heads=2,
                               intermediate_size=256)  # fmt: skip
    config.initializer_range = 0.2  # peaked distributions: rounding differences show in the logprobs
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def wiring_model():
    """The one-layer tiny Llama of the interpreter's end-to-end checks (tests/unit/workers/exact_*_wiring.py), in
    eval mode, initializer range 0.2 (peaked logits: sampled tokens are not ties)."""
    from transformers import AutoModelForCausalLM

    config = tiny_llama_config(len(build_char_tokenizer()), hidden_size=64, num_heads=4, num_kv_heads=2,
                               intermediate_size=64, num_layers=1)  # fmt: skip
    config.initializer_range = 0.2
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def wiring_loss_and_grads(model, ids, mask, exact: bool, temperature: float = 1.0, entropy_coef: float = 0.0):
    """(loss, every parameter's gradient) of a masked policy-gradient-shaped loss, -(logprob + entropy_coef *
    entropy) over the unmasked targets, with the model in exact mode or not (the wiring workers' gradient check)."""
    from rlx.logprobs import logprobs_from_logits

    model.zero_grad()
    with exact_forward(model) if exact else contextlib.nullcontext():
        logits = model(input_ids=ids, attention_mask=mask).logits
        logp, entropy = logprobs_from_logits(logits[:, :-1], ids[:, 1:], temperature, with_entropy=entropy_coef != 0)
        weights = mask[:, 1:].float()
        bonus = entropy_coef * entropy if entropy_coef else 0.0
        loss = -((logp + bonus) * weights).sum() / weights.sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _requests(batch: int, at: int) -> list[TokenRequest]:
    """`batch` requests with the probe at index `at`; the others random prompts, two of them the probe's prompt
    (so the probe may read its prompt's keys from blocks cached by another sequence)."""
    rng = random.Random(batch)
    out = []
    for i in range(batch):
        if i == at:
            out.append(TokenRequest(key="probe", prompt_ids=PROBE, max_new_tokens=NEW_TOKENS))
        elif i % 7 == 1:
            out.append(TokenRequest(key=f"same{i}", prompt_ids=PROBE, max_new_tokens=NEW_TOKENS))
        else:
            prompt = [1] + [rng.randrange(4, 19) for _ in range(rng.randrange(2, 14))]
            out.append(TokenRequest(key=f"r{i}", prompt_ids=prompt, max_new_tokens=rng.randrange(1, NEW_TOKENS + 1)))
    return out


def _generate(model, exact: bool, batch: int, at: int, temperature: float = 1.0):
    cfg = RolloutConfig(
        engine="native",
        exact=exact,
        kv_cache_gib=0.01,
        sampling=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=temperature),
        native=NativeConfig(block_size=4),
    )
    engine = make_engine(model, build_char_tokenizer(), cfg)
    requests = _requests(batch, at)
    generated = engine.generate_tokens(requests, dataclasses.replace(cfg.sampling, seed=3))
    return requests, generated


def _tensors(requests, generated, rows: list[int]):
    """prompt_ids/mask [b, P] left-padded and response_ids/mask [b, R] right-padded of the rows `rows`."""
    width_p = max(len(requests[i].prompt_ids) for i in rows)
    width_r = max(len(generated[i].response_ids) for i in rows)
    widths = {"prompt_ids": width_p, "prompt_mask": width_p, "response_ids": width_r, "response_mask": width_r}
    out = {k: torch.zeros(len(rows), w, dtype=torch.long) for k, w in widths.items()}
    for j, i in enumerate(rows):
        prompt, response = requests[i].prompt_ids, generated[i].response_ids
        out["prompt_ids"][j, width_p - len(prompt) :] = torch.tensor(prompt)
        out["prompt_mask"][j, width_p - len(prompt) :] = 1
        out["response_ids"][j, : len(response)] = torch.tensor(response)
        out["response_mask"][j, : len(response)] = 1
    return out


def _trainer_logprobs(
    model, requests, generated, probe: int, batch: int, packed: bool, temperature: float = 1.0
) -> torch.Tensor:
    """The training forward's logprobs of the probe's response, in a micro-batch of `batch` rows."""
    others = [i for i in range(len(requests)) if i != probe][: batch - 1]
    rows = others[: len(others) // 2] + [probe] + others[len(others) // 2 :]
    compute = packed_response_logprobs if packed else response_logprobs
    with torch.no_grad():
        tensors = _tensors(requests, generated, rows)
        logp, _ = compute(model, **tensors, temperature=temperature, dtype=torch.float32)
    return logp[rows.index(probe), : len(generated[probe].response_ids)]


def _all_logprobs(model, exact: bool) -> dict[str, torch.Tensor]:
    """The probe's logprobs from every path: rollout at batch 1, 3, 17; training forward padded/packed at 1, 3, 17."""
    out, tokens = {}, None
    for batch, at in ((1, 0), (3, 1), (17, 9)):
        requests, generated = _generate(model, exact, batch, at)
        out[f"rollout/{batch}"] = torch.tensor(generated[at].logprobs, dtype=torch.float32)
        tokens = tokens or generated[at].response_ids
        assert generated[at].response_ids == tokens or not exact
    for packed in (False, True):
        for batch in (1, 3, 17):
            with exact_forward(model) if exact else torch.no_grad():
                out[f"{'packed' if packed else 'padded'}/{batch}"] = _trainer_logprobs(
                    model, requests, generated, at, batch, packed
                )
    return out


def test_exact_mode_logprobs_are_bit_identical_across_batches_packing_and_cache(model):
    enable_packed_attention(model)  # the trainer's packed attention when exact mode is off
    exact = _all_logprobs(model, exact=True)
    reference = exact["rollout/1"]
    assert len(reference) == NEW_TOKENS
    for name, logp in exact.items():
        assert torch.equal(logp, reference), (name, (logp - reference).abs().max())
    plain = _all_logprobs(model, exact=False)
    first = plain["rollout/17"]
    differs = [n for n, logp in plain.items() if n.startswith(("padded", "packed")) and not torch.equal(logp, first)]
    assert differs, "without exact mode every path agreed bit for bit: the test could not fail"
    torch.testing.assert_close(plain["padded/17"], first, atol=1e-4, rtol=0)  # off: equal up to rounding only


def test_exact_flag_refused_by_other_engines(tmp_path, tiny_dir, prompts_file):
    for engine in ("hf", "vllm"):
        result = cli("rollout", "--model", tiny_dir, "--prompts", prompts_file, "--out", tmp_path / "r.jsonl",
                     "--engine", engine, "--exact")  # fmt: skip
        assert result.exit_code == 1 and "exact" in result.stderr and "native" in result.stderr, result
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE.format(model=tiny_dir, prompts=prompts_file, mini_batch=0, packing="false", reward="x")
                      .replace('engine = "native"', 'engine = "hf"'))  # fmt: skip
    result = cli("ppo", recipe, "--out", tmp_path / "run")
    assert result.exit_code == 1 and "rollout.engine: exact = true needs engine 'native'" in result.stderr, result


RECIPE = """
seed = 0
steps = 2
exact = true
[model]
path = "{model}"
init = "random"
[data]
prompts = "{prompts}"
prompts_per_step = 2
[rollout]
engine = "native"
kv_cache_gib = 0.01
[rollout.sampling]
n = 3
max_new_tokens = 4
[rollout.native]
block_size = 4
[score]
reward = "{reward}:score"
use_packing = {packing}
[train]
mini_batch_size = {mini_batch}
micro_batch_size = 2
use_packing = {packing}
[train.optim]
lr = 1e-2
"""


def test_gpu_fast_path_leaves_compile_off_in_exact_mode():
    from rlx.ppo.defaults import fast_path_defaults

    assert fast_path_defaults("cuda", {})["train.compile"] is True
    exact = fast_path_defaults("cuda", {"exact": True})
    assert "train.compile" not in exact and exact["rollout.engine"] == "native"
    budget = fast_path_defaults("cuda", {})["train.max_tokens_per_micro_batch"]
    assert exact["train.max_tokens_per_micro_batch"] == exact["score.max_tokens_per_micro_batch"] == budget == 32768


@pytest.mark.parametrize("mini_batch,packing", [(3, "true"), (0, "false")])
def test_ppo_exact_rollout_correction_is_zero(tmp_path, tiny_dir, prompts_file, mini_batch, packing):
    """Two mini-batches: the score phase runs the actor's exact forward, and the rollout_corr/* mismatch is 0 at
    each step (after an update too). One mini-batch: the rollout's logprobs are the old ones, without a forward."""
    recipe = tmp_path / "recipe.toml"
    reward = write_length_reward(tmp_path)  # non-zero advantages: step 2 samples from updated weights
    recipe.write_text(RECIPE.format(model=tiny_dir, prompts=prompts_file, mini_batch=mini_batch, packing=packing,
                                    reward=reward))  # fmt: skip
    cli_ok("ppo", recipe, "--out", tmp_path / "run")
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(lines) == 2 and lines[0]["actor/grad_norm"] > 0
    for line in lines:
        assert line["score/old_logprobs_from_rollout"] == float(mini_batch == 0)
        assert line["rollout_corr/logprob_abs_diff_max"] == 0.0, line
        assert line["rollout_corr/kl_k1"] == 0.0


def test_exact_commands_by_hand(tmp_path, tiny_ckpt, prompts_file):
    """`rlx rollout --exact` then `rlx score --exact` (packed): the old logprobs equal the sampler's; `rlx eval
    --exact` and `rlx train-step --exact` run on the native engine's and the trainer's exact paths."""
    rollouts, scored, metrics = tmp_path / "rollouts.jsonl", tmp_path / "scored", tmp_path / "metrics.jsonl"
    cli_ok("rollout", "--model", tiny_ckpt, "--prompts", prompts_file, "--out", rollouts, "--n", "3",
           "--max-new-tokens", "4", "--num-prompts", "3", "--engine", "native", "--exact")  # fmt: skip
    reward = write_length_reward(tmp_path)
    cli_ok("score", "--rollouts", rollouts, "--out", scored, "--actor", tiny_ckpt, "--reward", f"{reward}:score",
           "--exact", "--use-packing", "--metrics", metrics)  # fmt: skip
    line = read_jsonl(metrics)[-1]
    assert line["rollout_corr/logprob_abs_diff_max"] == 0.0, line
    cli_ok("train-step", "--checkpoint", tiny_ckpt, "--batch", scored / "batch.safetensors", "--out",
           tmp_path / "step1", "--exact", "--lr", "1e-3", "--metrics", metrics)  # fmt: skip
    assert read_jsonl(metrics)[-1]["actor/ppo_kl"] == 0.0  # one update: the new logprobs are the old ones exactly
    cli_ok("train-step", "--checkpoint", tiny_ckpt, "--batch", scored / "batch.safetensors", "--out",
           tmp_path / "step1c", "--exact", "--lr", "1e-3", "--gradient-checkpointing",
           "--metrics", metrics)  # fmt: skip
    assert read_jsonl(metrics)[-1]["actor/ppo_kl"] == 0.0  # layers recomputed in exact mode (checkpoint_contexts)
    cli_ok("eval", "--model", tiny_ckpt, "--prompts", prompts_file, "--out", tmp_path / "eval", "--engine", "native",
           "--exact", "--max-new-tokens", "3")  # fmt: skip
    result = cli("eval", "--model", tiny_ckpt, "--prompts", prompts_file, "--out", tmp_path / "eval2", "--exact")
    assert result.exit_code == 1 and "needs engine 'native'" in result.stderr, result


def _run_turns(engine, sampling, tool_reply: list[int]) -> list:
    """Two turns of one sample through one stream: [(context, Generated)]; the second turn's context is the first's
    context, its response and `tool_reply` (its blocks cached in the stream by the first turn)."""
    stream = engine.open_stream(sampling, 64, 2)
    turns, context = [], PROBE
    try:
        for turn in range(2):
            stream.submit(turn, TokenRequest(key=f"t/{turn}", prompt_ids=context, max_new_tokens=NEW_TOKENS))
            done = []
            while not done:
                done = stream.step()
            turns.append((context, done[0][1]))
            context = context + done[0][1].response_ids + tool_reply
        assert stream.stats()["cached_prefix_tokens"] > 0  # the second turn read the first one's blocks
    finally:
        stream.close()
    return turns


def cached_second_turn(engine, sampling: SamplingParams) -> tuple[TokenRequest, Generated]:
    """(request, Generated) of a second turn whose context begins with the first turn (its blocks cached in the
    stream), checked to equal the same context generated fresh, tokens and logprobs bit for bit."""
    sampling = dataclasses.replace(sampling, seed=5)
    (_, first), (context, second) = _run_turns(engine, sampling, [11, 12, 13, 14, 15])
    assert len(context) > len(PROBE) + len(first.response_ids)
    request = TokenRequest(key="t/1", prompt_ids=context, max_new_tokens=NEW_TOKENS)
    fresh = engine.generate_tokens([request], sampling)[0]
    assert fresh.response_ids == second.response_ids
    assert torch.equal(torch.tensor(fresh.logprobs), torch.tensor(second.logprobs))
    return request, second


def test_exact_multi_turn_reads_cached_turns_alike(model):
    """A second turn whose context begins with the first turn (its blocks cached in the stream) gets the logprobs of
    the same context generated fresh and of the training forward over it."""
    cfg = RolloutConfig(
        engine="native",
        exact=True,
        kv_cache_gib=0.01,
        sampling=SamplingParams(max_new_tokens=NEW_TOKENS),
        native=NativeConfig(block_size=4),
    )
    request, second = cached_second_turn(make_engine(model, build_char_tokenizer(), cfg), cfg.sampling)
    with exact_forward(model):
        trained = _trainer_logprobs(model, [request], [second], 0, 1, packed=True)
    assert torch.equal(trained, torch.tensor(second.logprobs, dtype=torch.float32))


def test_exact_attention_matches_sdpa_with_gradients():
    """The "rlx_exact" attention function on a padded batch: the values and gradients of SDPA's causal attention, up
    to rounding (the backward goes through recomputation)."""
    from rlx.models.exact import exact_attention_forward

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 40, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0  # left padding
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = exact_attention_forward(torch.nn.Module(), *leaves, mask)
    assert not out[1, :7].detach().any()  # padded positions are 0
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = []
    for row, start in ((0, 0), (1, 7)):
        qr, kr, vr = (t[row : row + 1, :, start:] for t in ref_leaves)
        o = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True, enable_gqa=True)
        ref.append((o.transpose(1, 2)[0], row, start))
    total = sum((o * weights[row, start:]).sum() for o, row, start in ref)
    total.backward()
    for o, row, start in ref:
        torch.testing.assert_close(out[row, start:], o, atol=1e-5, rtol=1e-4)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-4, rtol=1e-3)


def test_exact_mode_refuses_unsupported_models():
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlx.errors import UserError

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=20, n_positions=16))
    with pytest.raises(UserError, match="model type 'gpt2' is not supported"), exact_forward(model):
        pass


def test_exact_mode_trains_with_activation_checkpointing():
    """Layers checkpointed inside exact mode are recomputed inside it (the backward runs after the block closed):
    the gradients equal those of the same exact step without checkpointing; without the recompute context the
    checkpoint stops with a count mismatch of saved tensors."""
    from transformers import AutoModelForCausalLM

    from rlx.models.exact import checkpoint_contexts

    config = tiny_llama_config(len(build_char_tokenizer()), hidden_size=64, num_heads=4, num_kv_heads=2,
                               intermediate_size=64, num_layers=2)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    ids = torch.randint(3, config.vocab_size, (2, 12))

    def grads(checkpointing: dict | None) -> list[torch.Tensor]:
        model.zero_grad()
        if checkpointing is None:
            model.gradient_checkpointing_disable()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, **checkpointing})
        with exact_forward(model):
            logits = model(input_ids=ids).logits
            loss = target_logprobs(logits[:, :-1], ids[:, 1:], 1.0)[0].sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads(None)
    recomputed = grads({"context_fn": checkpoint_contexts})
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed))
    with pytest.raises(Exception, match="different number of tensors"):
        grads({})
