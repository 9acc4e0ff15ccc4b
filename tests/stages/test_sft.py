"""`rlx sft` and a recipe's [sft] warm start: demonstrations tokenised exactly as a multi-turn rollout of the same
conversation, the loss is the mean NLL of the assistant's tokens only, the loss falls, text prompt/response lines,
bad input, and [sft] in `rlx ppo` (step-0 checkpoint kept through rotation, the reference of a resumed run)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from rlx.agent.driver import EnvRollout
from rlx.checkpoints.registry import read_meta
from rlx.formats.records import PromptRecord
from rlx.models.loading import ModelSource, load_tokenizer
from rlx.parallel.dist import DistContext
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.config import SamplingParams
from rlx.sft.config import SFTConfig
from rlx.sft.data import read_demonstrations, tokenize_demonstrations
from rlx.stages.sft import fine_tune
from rlx.tasks.calculator import CalculatorEnv, demonstration, generate_calculator
from rlx.training.config import OptimConfig
from tests.agent_helpers import bigram_chat_model, token_engine
from tests.conftest import REPO, cli, cli_ok, max_diff, read_jsonl, torchrun, write_jsonl

TINY_CHAT = REPO / "recipes" / "tiny-chat"
# The template's own rendering of a calculator call, one token per piece, so a bigram model writes it verbatim.
CANONICAL_PIECES = ('\n{"name": ', '"calculator"', ', "arguments": ', '{"expression": ', '"12*34"', "}}\n")
CANONICAL_SCRIPT = "\n<tool_call>" + "".join(CANONICAL_PIECES) + "</tool_call><|im_end|>"


def demos_file(tmp_path, num: int = 16, digits: int = 1, seed: int = 1):
    records = [demonstration(r) for r in generate_calculator(num, seed=seed, digits=digits)]
    return write_jsonl(tmp_path / "demos.jsonl", records)


def test_demonstration_tokens_are_those_of_a_rollout_of_the_same_conversation(tmp_path):
    """A model that calls the calculator as the template writes the call: its rollout's record, read back as a
    demonstration, gives the rollout's prompt ids, response ids and loss mask exactly."""
    model, tokenizer = bigram_chat_model(CANONICAL_SCRIPT, extra_tokens=CANONICAL_PIECES)
    engine = token_engine(model, tokenizer)
    agent = AgentConfig(env="rlx.tasks.calculator:CalculatorEnv", max_turns=2)
    runner = EnvRollout(engine, tokenizer, SamplingParams(n=1, max_new_tokens=24), agent)
    [rec] = runner.generate([PromptRecord(id="c", prompt="12*34", ground_truth="408")]).records
    assert rec.num_turns == 2 and rec.messages[1]["tool_calls"] and rec.messages[2]["content"] == "408"
    line = {"messages": rec.messages, "tools": CalculatorEnv.tools}
    demos = read_demonstrations(str(write_jsonl(tmp_path / "d.jsonl", [line])))
    [sample] = tokenize_demonstrations(demos, tokenizer, {tokenizer.eos_token_id}, 1000, "error", "x").samples
    assert (sample.prompt_ids, sample.response_ids) == (rec.prompt_ids, rec.response_ids)
    assert sample.loss_mask == rec.loss_mask and 0 in sample.loss_mask


def _manual_nll(model, sample) -> tuple[float, int]:
    """Sum of -log p over the sample's trained tokens, by a plain forward of the whole sequence, and their count."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1)[0]
    p = len(sample.prompt_ids)
    total = sum(-logp[p + i - 1, t].item() for i, (t, m) in enumerate(zip(sample.response_ids, sample.loss_mask)) if m)
    return total, sum(sample.loss_mask)


def test_loss_is_the_mean_nll_of_the_assistant_tokens_only(tmp_path):
    """The trained tokens decode to the assistant's turns (tool call and answer, each through <|im_end|>); the first
    step's loss equals the NLL of exactly those tokens by a plain forward; a prompt/response line equals the same
    conversation given as messages."""
    from rlx.checkpoints.loading import load_initial_policy

    model, tokenizer, _ = load_initial_policy(TINY_CHAT, "random", 0)
    path = demos_file(tmp_path, num=4)
    samples = tokenize_demonstrations(read_demonstrations(str(path)), tokenizer, {102}, 1000, "error", "x").samples
    record = read_jsonl(path)[0]
    question, result = record["messages"][0]["content"], record["messages"][2]["content"]
    trained = tokenizer.decode([t for t, m in zip(samples[0].response_ids, samples[0].loss_mask) if m])
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{question}"}}}}\n</tool_call>'
    assert trained == f"{call}<|im_end|>{result}<|im_end|>"
    assert tokenizer.decode(samples[0].prompt_ids).endswith(f"{question}<|im_end|>\n<|im_start|>assistant\n")
    total, count = map(sum, zip(*(_manual_nll(model, s) for s in samples)))
    cfg = SFTConfig(data=str(path), optim=OptimConfig(lr=0.0), batch_size=4, micro_batch_size=2, max_steps=1)
    _, metrics = fine_tune(model, tokenizer, samples, cfg, DistContext(device=torch.device("cpu")))
    assert metrics["sft/tokens"] == count and math.isclose(metrics["sft/loss"], total / count, rel_tol=1e-5)
    plain = {"prompt": question, "response": "4", "tools": CalculatorEnv.tools}
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": "4"}]
    chat = {"messages": messages, "tools": plain["tools"]}
    both = read_demonstrations(str(write_jsonl(tmp_path / "two.jsonl", [plain, chat])))
    a, b = tokenize_demonstrations(both, tokenizer, {102}, 1000, "error", "x").samples
    assert (a.prompt_ids, a.response_ids, a.loss_mask) == (b.prompt_ids, b.response_ids, b.loss_mask)


def test_sft_lowers_the_loss_and_writes_a_step0_checkpoint(tmp_path):
    """~10 s: `rlx sft` on 16 calculator demonstrations; the loss falls by three quarters; the output is a step-0
    'single' checkpoint without optimizer state that the other commands read."""
    out, metrics = tmp_path / "ckpt", tmp_path / "sft.jsonl"
    args = ["--data", demos_file(tmp_path), "--out", out, "--metrics", metrics, "--init", "random"]
    result = cli_ok("sft", "--model", TINY_CHAT, *args, "--epochs", "8", "--batch-size", "4", "--lr", "5e-3")
    lines = read_jsonl(metrics)
    assert [line["step"] for line in lines] == list(range(1, 33)) and "step 32/32" in result.stderr
    assert lines[-1]["sft/loss"] < 0.25 * lines[0]["sft/loss"] and lines[0]["sft/tokens"] > 0
    meta = read_meta(out)
    assert (meta.step, meta.layout) == (0, "single") and not (out / "optimizer.safetensors").exists()
    cli_ok("merge", "--checkpoint", out, "--out", tmp_path / "hf")
    assert load_tokenizer(ModelSource(tmp_path / "hf")).chat_template


def test_text_prompt_response_lines_without_a_chat_template(tmp_path, tiny_dir):
    """No chat template: the prompt as `rlx rollout` encodes text, the response and EOS trained; chat lines are an
    error naming the line."""
    tokenizer = load_tokenizer(ModelSource(tiny_dir))
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+2=", "response": "3"}, {"prompt": "2+2=", "response": "4"}])
    [sample, _] = tokenize_demonstrations(read_demonstrations(str(path)), tokenizer, {2}, 100, "error", "x").samples
    assert sample.prompt_ids == tokenizer("1+2=")["input_ids"]
    assert sample.response_ids == tokenizer("3", add_special_tokens=False)["input_ids"] + [2]
    assert sample.loss_mask == [1, 1]
    cli_ok("sft", "--model", tiny_dir, "--init", "random", "--data", path, "--out", tmp_path / "out", "--lr", "1e-3")
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "yo"}]}])  # fmt: skip
    result = cli("sft", "--model", tiny_dir, "--init", "random", "--data", chat, "--out", tmp_path / "bad")
    assert result.exit_code == 1
    assert "chat.jsonl:1: chat messages need a tokenizer with a chat template" in result.stderr
    assert not (tmp_path / "bad").exists()


USER = {"role": "user", "content": "2*3"}


@pytest.mark.parametrize(
    ("lines", "options", "message"),
    [
        ([{"messages": [USER, {"role": "assistant", "content": "6"}]}, "{not json"], [], "d.jsonl:2: malformed JSON"),
        ([{"messages": [USER]}], [], "d.jsonl:1: no assistant message"),
        ([{"messages": [USER, {"role": "robot", "content": "6"}]}], [], "d.jsonl:1: message 1: role 'robot'"),
        ([{"prompt": "2*3"}], [], "d.jsonl:1: expected a 'messages' list, or 'prompt' and 'response'"),
        ([{"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "c",
          "arguments": "{oops"}}]}]}], [], "d.jsonl:1: message 1, tool call 0: 'arguments' is a string but not JSON"),
        ([{"prompt": "2*3", "response": "6"}, {"prompt": "2*3" * 40, "response": "6"}], ["--max-length", "64"],
         "d.jsonl:2: 141 tokens, longer than max_length 64"),
        ([{"prompt": "2*3" * 40, "response": "6"}], ["--max-length", "64", "--on-long-sample", "skip"],
         "every demonstration is longer than max_length 64"),
        ([], [], "d.jsonl: no demonstrations"),
        ([{"prompt": "2*3", "response": "6"}], ["--init", "zero"], "--init 'zero': expected 'pretrained' or 'random'"),
        ([{"prompt": "2*3", "response": "6"}], ["--batch-size", "0"], "--batch-size: must be at least 1"),
        ([{"prompt": "2*3", "response": "6"}], ["--chat-template-kwargs", "{oops"],
         "--chat-template-kwargs: not valid JSON"),
        ([{"prompt": "2*3", "response": "6"}], ["--chat-template-kwargs", "[1]"],
         "--chat-template-kwargs: must be a JSON object"),
    ],
)  # fmt: skip
def test_bad_demonstrations_and_options(tmp_path, lines, options, message):
    path = tmp_path / "d.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    result = cli("sft", "--model", TINY_CHAT, "--init", "random", "--data", path, "--out", tmp_path / "out", *options)
    assert result.exit_code == 1 and message in result.stderr, result
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_chat_template_kwargs_reach_the_demonstrations(tmp_path):
    """A Qwen3-style template with enable_thinking false pre-fills an empty think block at each assistant turn: the
    demonstration's tokens are those of the template with the variable, as a rollout with the same kwargs gets."""
    from rlx.models.tiny_chat import build_chat_tokenizer

    tokenizer = build_chat_tokenizer("qwen3")
    line = {"messages": [USER, {"role": "assistant", "content": "6"}]}
    demos = read_demonstrations(str(write_jsonl(tmp_path / "d.jsonl", [line])))
    stop = {tokenizer.eos_token_id}
    [plain] = tokenize_demonstrations(demos, tokenizer, stop, 1000, "error", "x").samples
    [off] = tokenize_demonstrations(demos, tokenizer, stop, 1000, "error", "x", {"enable_thinking": False}).samples
    want = tokenizer.apply_chat_template([USER], add_generation_prompt=True, enable_thinking=False, return_dict=True)
    assert off.prompt_ids == list(want["input_ids"]) != plain.prompt_ids
    assert tokenizer.decode(off.prompt_ids).endswith("<think>\n\n</think>\n\n")
    assert tokenizer.decode(off.response_ids).startswith("6")


def test_ppo_sft_under_torchrun_fine_tunes_on_every_rank(tmp_path):
    """~40 s: [sft] in a 2-rank FSDP run fine-tunes data-parallel (both ranks log nothing twice) and gives the step-0
    weights and losses of the one-process run."""
    small = ["--set", "data.prompts_per_step=2", "--set", "rollout.sampling.n=2",
             "--set", "rollout.sampling.max_new_tokens=4",
             "--set", "sft.max_steps=2", "--set", "sft.batch_size=4", "--set", "sft.micro_batch_size=1",
             "--set", "steps=1"]  # fmt: skip
    recipe = REPO / "recipes" / "calculator.toml"
    cli_ok("ppo", recipe, "--out", tmp_path / "one", *small)
    result = torchrun(2, "ppo", recipe, "--out", tmp_path / "two", *small)
    said = result.stdout + result.stderr
    assert said.count("[sft] fine-tuning") == 1 and "demonstrations (" in said and "), 2 processes" in said
    step0 = Path("checkpoints") / "step_000000"
    assert max_diff(tmp_path / "one" / step0, tmp_path / "two" / step0) < 1e-5
    one, two = (read_jsonl(tmp_path / run / "sft_metrics.jsonl") for run in ("one", "two"))
    assert len(one) == len(two) == 2 and all(abs(a["sft/loss"] - b["sft/loss"]) < 1e-5 for a, b in zip(one, two))


def test_ppo_sft_takes_the_rollout_chat_template_kwargs_unless_it_sets_its_own():
    from rlx.ppo.config import load_recipe
    from rlx.ppo.warm_start import sft_settings

    recipe = REPO / "recipes" / "calculator.toml"
    thinking = "{enable_thinking = false}"  # a TOML inline table, as in a recipe
    cfg = load_recipe(recipe, [f"rollout.agent.chat_template_kwargs={thinking}", "seed=5"])
    assert sft_settings(cfg).chat_template_kwargs == {"enable_thinking": False} and sft_settings(cfg).seed == 5
    own = load_recipe(recipe, [f"rollout.agent.chat_template_kwargs={thinking}", "sft.chat_template_kwargs={x = 1}"])
    assert sft_settings(own).chat_template_kwargs == {"x": 1}


def test_long_demonstrations_are_skipped_with_a_count_and_outputs_are_not_overwritten(tmp_path):
    lines = [{"prompt": "2*3", "response": "6"}, {"prompt": "2*3" * 40, "response": "6"}]
    data = write_jsonl(tmp_path / "d.jsonl", lines)
    args = ["sft", "--model", TINY_CHAT, "--init", "random", "--data", data, "--out", tmp_path / "out"]
    result = cli_ok(*args, "--max-length", "64", "--on-long-sample", "skip", "--metrics", tmp_path / "m.jsonl")
    assert "skipped 1 demonstration(s) longer than 64 tokens" in result.stderr
    assert read_jsonl(tmp_path / "m.jsonl")[0]["sft/tokens"] > 0
    again = cli(*args)
    assert again.exit_code == 1 and "already exists" in again.stderr


def test_sft_warm_start_in_ppo_keeps_step_0_as_the_reference_through_rotation_and_resume(tmp_path):
    """~25 s: [sft] writes checkpoints/step_000000 and sft_metrics.jsonl; rotation keeps step 0; a resumed step's
    reference logprobs are those of step 0 (rlx score --ref step_000000 gives the same batch)."""
    run = tmp_path / "run"
    small = ["--set", "data.prompts_per_step=2", "--set", "rollout.sampling.n=2",
             "--set", "rollout.sampling.max_new_tokens=12",
             "--set", "sft.max_steps=2", "--set", "keep_checkpoints=1", "--set", "save_every=1"]  # fmt: skip
    recipe = REPO / "recipes" / "calculator.toml"
    cli_ok("ppo", recipe, "--out", run, "--set", "steps=2", *small)
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_000000", "step_000002"] and len(read_jsonl(run / "sft_metrics.jsonl")) == 2
    assert read_meta(run / "checkpoints" / "step_000000").step == 0
    shutil.copytree(run / "checkpoints" / "step_000002", tmp_path / "actor2")  # rotated away by the resumed run
    cli_ok("ppo", recipe, "--out", run, "--set", "steps=3", "--resume", *small)
    step3, again = run / "step_000003", tmp_path / "again"
    ref = run / "checkpoints" / "step_000000"
    cli_ok("score", "--rollouts", step3 / "rollouts.jsonl", "--actor", tmp_path / "actor2", "--ref", ref,
           "--reward", "env", "--micro-batch-size", "128", "--out", again)  # fmt: skip
    from rlx.formats.batch import TrainBatch

    ours, theirs = TrainBatch.load(step3 / "batch.safetensors"), TrainBatch.load(again / "batch.safetensors")
    assert torch.equal(ours.ref_logprobs, theirs.ref_logprobs)
    bad = cli("ppo", recipe, "--out", tmp_path / "bad", "--set", "sft.data=missing.jsonl", *small)
    assert bad.exit_code == 1 and "missing.jsonl: no such file" in bad.stderr and not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_two_ranks_equal_one(tmp_path):
    """~25 s: `rlx sft` under torchrun (2 gloo ranks, each step's demonstrations split by work, FSDP) gives the
    weights and losses of one process."""
    data = demos_file(tmp_path, num=8)
    args = ["sft", "--model", TINY_CHAT, "--init", "random", "--data", data, "--batch-size", "4", "--micro-batch-size",
            "1", "--lr", "1e-2", "--epochs", "2"]  # fmt: skip
    cli_ok(*args, "--out", tmp_path / "one", "--metrics", tmp_path / "one.jsonl")
    torchrun(2, *args, "--out", tmp_path / "two", "--metrics", tmp_path / "two.jsonl")
    assert max_diff(tmp_path / "one", tmp_path / "two") < 1e-5
    one, two = read_jsonl(tmp_path / "one.jsonl"), read_jsonl(tmp_path / "two.jsonl")
    assert len(one) == len(two) == 4 and all(abs(a["sft/loss"] - b["sft/loss"]) < 1e-5 for a, b in zip(one, two))


def test_a_template_that_drops_tool_calls_is_refused_naming_the_demonstration(tmp_path):
    """A plain ChatML template (SmolLM2's) writes an assistant message's `tool_calls` as nothing: training on it would
    teach the model to answer with an empty turn. The error names the line and says how to write such calls."""
    model = shutil.copytree(TINY_CHAT, tmp_path / "plain")
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    result = cli("sft", "--model", model, "--init", "random", "--data", demos_file(tmp_path), "--out", tmp_path / "o")
    assert result.exit_code == 1, result
    assert "demos.jsonl:1: message 1: the chat template does not write tool calls" in result.stderr
    assert "'content'" in result.stderr and not (tmp_path / "o").exists()


def test_a_warm_start_stopped_part_way_runs_again_from_its_first_step(tmp_path, monkeypatch):
    """~20 s: a run stopped during its [sft] warm start (SIGTERM's exception raised after the 2nd of 4 optimizer steps,
    as the command's handler raises it) exits 143 saying --resume fine-tunes again from the first step (`rlx sft`
    saves no checkpoint part-way), with no step-0 checkpoint or temporary left; --resume says so again and runs the
    whole warm start (its first step's loss is the stopped one's, 4 metrics lines), then the RL step."""
    from rlx.errors import Terminated
    from rlx.sft.trainer import SFTTrainer

    real, stop_at = SFTTrainer.train_step, [1]

    def step_then_stop(self, batch, step):
        metrics = real(self, batch, step)
        if step in stop_at:
            raise Terminated("terminated by SIGTERM")
        return metrics

    monkeypatch.setattr(SFTTrainer, "train_step", step_then_stop)
    run, recipe = tmp_path / "run", REPO / "recipes" / "calculator.toml"
    small = ["--set", "data.prompts_per_step=2", "--set", "rollout.sampling.n=2", "--set", "steps=1",
             "--set", "rollout.sampling.max_new_tokens=4", "--set", "sft.max_steps=4"]  # fmt: skip
    stopped = cli("ppo", recipe, "--out", run, *small)
    assert stopped.exit_code == 143, stopped.stderr[-2000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert "--resume starts the run again at step 1, and its [sft] warm start again from its first step" in last
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    first = read_jsonl(run / "sft_metrics.jsonl")
    assert len(first) == 1  # the step stopped in is not logged
    stop_at.clear()
    resumed = cli("ppo", recipe, "--out", run, "--resume", *small)
    assert resumed.exit_code == 0, resumed.stderr[-2000:]
    assert "the [sft] warm start, stopped after 1 step(s), runs again from its first step" in resumed.stderr
    again = read_jsonl(run / "sft_metrics.jsonl")
    assert len(again) == 4 and again[0]["sft/loss"] == first[0]["sft/loss"]
    assert read_meta(run / "checkpoints" / "step_000000").step == 0 and len(read_jsonl(run / "metrics.jsonl")) == 1


def test_resume_reuses_a_finished_warm_start_when_nothing_it_depends_on_changed(tmp_path, capsys):
    """A run folder whose [sft] warm start finished (checkpoints/step_000000) but whose run checkpointed no RL step:
    --resume keeps the warm start when its recipe keys ([sft], [model], seed, train.device, the chat template's
    variables), its demonstrations' sha256, its device and its model's files (sizes and times) are those recorded, in
    one line; any of them changed runs it again, naming what changed, as does a record from before the model's files
    were recorded. Without --resume the folder starts again (the warm start too), and steps that ran are
    never thrown away unasked: refused, the warm start left in place. --overwrite clears it all."""
    from rlx.checkpoints.meta import CheckpointMeta
    from rlx.config import to_dict
    from rlx.errors import UserError
    from rlx.ppo.config import load_recipe
    from rlx.ppo.rundir import prepare_run_dir
    from rlx.ppo.warm_start import warm_start_record

    recipe = REPO / "recipes" / "calculator.toml"
    cfg = load_recipe(recipe)
    record = warm_start_record(cfg, torch.device("cpu"), ModelSource(TINY_CHAT))
    assert len(record["data_sha256"]) == 64 and record["device"] == "cpu" and "config.json" in record["model_files"]
    model = shutil.copytree(TINY_CHAT, tmp_path / "model")  # the same files (and times) as the recipe's model
    (model / "model.safetensors").write_bytes(b"{}")
    weights_added = warm_start_record(cfg, torch.device("cpu"), ModelSource(model))
    (model / "model.safetensors").unlink()
    (model / "config.json").write_text((model / "config.json").read_text())  # the same bytes, written again
    config_rewritten = warm_start_record(cfg, torch.device("cpu"), ModelSource(model))

    def stopped_run(name: str, steps_done: int = 0, recorded: dict | None = record) -> Path:
        """A folder as a run leaves it when it stops before its first RL checkpoint, its warm start finished."""
        run = tmp_path / name
        step0 = run / "checkpoints" / "step_000000"
        step0.mkdir(parents=True)
        CheckpointMeta(step=0, provenance={"created_by": "rlx ppo [sft]", **(recorded or {})}).write(step0)
        (run / "recipe.json").write_text(json.dumps(to_dict(cfg)))
        (run / "sft_metrics.jsonl").write_text('{"step": 1, "sft/loss": 1.5}\n')
        (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, steps_done + 1)))
        return run

    def start(run: Path, overrides=(), resume=True, overwrite=False, now=record) -> tuple[bool, str]:
        new = to_dict(load_recipe(recipe, list(overrides)))
        kept = prepare_run_dir(run, new, resume, True, overwrite, now).warm_start_kept
        said = capsys.readouterr().err.strip().splitlines()
        assert len(said) == 1, said
        assert kept == (run / "checkpoints" / "step_000000" / "rlx.json").is_file() == (run / SFT).is_file()
        return kept, said[0]

    SFT = "sft_metrics.jsonl"
    kept, said = start(stopped_run("same", steps_done=1), ["rollout.sampling.temperature=1.0"])  # not an [sft] input
    assert kept and "completed 1 step(s) but wrote no checkpoint" in said and "starting at step 1" in said
    assert "its finished [sft] warm start is reused" in said and "model and its files, seed, demonstrations" in said
    assert not (tmp_path / "same" / "metrics.jsonl").exists()  # the RL steps go, the warm start stays
    for overrides, now, change in [
        (["sft.optim.lr=1e-3"], record, "sft.optim.lr changed (0.003 -> 0.001)"),
        (["seed=2"], record, "seed changed (1 -> 2)"),
        (["model.init='pretrained'"], record, "model.init changed ('random' -> 'pretrained')"),
        (["rollout.agent.chat_template_kwargs={enable_thinking = false}"], record,
         "rollout.agent.chat_template_kwargs.enable_thinking changed (None -> False)"),
        ([], {**record, "data_sha256": "0" * 64}, "the demonstrations in "),
        ([], {**record, "device": "cuda"}, "the device changed (cpu -> cuda)"),
        ([], weights_added, "the model's weights changed (model.safetensors appeared since the warm start, by its "),
        ([], config_rewritten, "the model's files changed (config.json was rewritten since the warm start"),
    ]:  # fmt: skip
        kept, said = start(stopped_run(change[:20].replace(" ", "_")), overrides, now=now)
        assert not kept and f"which had finished, runs again from its first step: {change}" in said
    kept, said = start(stopped_run("old", recorded=None))
    assert not kept and "does not record the demonstrations and device it trained on" in said
    kept, said = start(stopped_run("older", recorded={k: v for k, v in record.items() if k != "model_files"}))
    assert not kept and "predates the check of the model's files (written by an older rlx)" in said
    kept, said = start(stopped_run("plain"), resume=False)
    assert not kept and "completed no step" in said
    assert "the [sft] warm start, which had finished, runs again from its first step (its checkpoint goes too" in said
    refused = stopped_run("refused", steps_done=2)
    with pytest.raises(UserError, match="completed 2 step"):
        prepare_run_dir(refused, to_dict(cfg), False, True, False, record)
    assert (refused / "checkpoints" / "step_000000" / "rlx.json").is_file() and (refused / SFT).is_file()
    kept, said = start(refused, resume=False, overwrite=True)
    assert not kept and said.endswith("replacing its run (--overwrite); starting at step 1")


def test_a_run_stopped_before_its_first_checkpoint_resumes_on_its_finished_warm_start(tmp_path, monkeypatch):
    """~30 s: a run killed in step 2 (save_every 2: no RL checkpoint yet) after its warm start finished says --resume
    reuses the warm start; --resume then starts at step 1 on the same step-0 checkpoint (not fine-tuned again: its files
    and sft_metrics.jsonl untouched) and ends with the weights of a run never stopped."""
    from rlx.errors import Terminated
    from rlx.ppo.loop import PPORun

    real, stop_at = PPORun.step, [2]

    def step_or_stop(self, step, log):
        if step in stop_at:
            raise Terminated("terminated by a second SIGTERM")
        return real(self, step, log)

    monkeypatch.setattr(PPORun, "step", step_or_stop)
    recipe = REPO / "recipes" / "calculator.toml"
    small = ["--set", "data.prompts_per_step=2", "--set", "rollout.sampling.n=2", "--set", "steps=2", "--set",
             "save_every=2", "--set", "rollout.sampling.max_new_tokens=4", "--set", "sft.max_steps=2"]  # fmt: skip
    run, step0 = tmp_path / "run", Path("checkpoints") / "step_000000"
    stopped = cli("ppo", recipe, "--out", run, *small)
    assert stopped.exit_code == 143, stopped.stderr[-2000:]
    assert "--resume starts the run again at step 1, reusing its finished [sft] warm start" in stopped.stderr
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1]
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in (run / step0).iterdir()}
    sft_lines = (run / "sft_metrics.jsonl").read_text()
    stop_at.clear()
    resumed = cli("ppo", recipe, "--out", run, "--resume", *small)
    assert resumed.exit_code == 0, resumed.stderr[-2000:]
    assert "completed 1 step(s) but wrote no checkpoint" in resumed.stderr
    assert "its finished [sft] warm start is reused" in resumed.stderr and "[sft] fine-tuning" not in resumed.stderr
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in (run / step0).iterdir()} == before
    assert (run / "sft_metrics.jsonl").read_text() == sft_lines
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    cli_ok("ppo", recipe, "--out", tmp_path / "whole", *small)
    last = Path("checkpoints") / "step_000002"
    assert max_diff(run / last, tmp_path / "whole" / last) == 0
