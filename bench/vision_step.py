"""Vision-language throughput on one GPU: rlx's rollout and train step against transformers' padded `generate` and
padded forward/backward, in the same process, on a Qwen2-VL-2B-shaped model with one 448 x 448 image per prompt.

    python bench/vision_step.py --json vision.json          # one GPU (the lead runs it)
    python bench/vision_step.py --small --cpu               # a quick check of the script (tiny Qwen2-VL)

The model: Qwen2-VL-2B's shape (decoder 28 layers, hidden 1536, 12 heads / 2 KV heads, vocab 151936, tied head;
vision tower 32 blocks, 1280 wide, 14-pixel patches merged 2 x 2), randomly initialised, written with rlx's
character tokenizer plus the family's special tokens (`rlx shard --init random`). Each prompt: one 448 x 448
image of coloured shapes (rlx.tasks.shapes, 256 image tokens after merging) and a question.

Rollout: the native engine (`rlx rollout --engine native`: vision tower in the prefill, mRoPE in decode, paged KV
cache, CUDA graphs) and the hf engine, against `model.generate` on left-padded batches of --baseline-rows prompts
with their pixel values; every tool samples --max-new-tokens tokens per sample at temperature 1 (a random model
rarely stops; transformers is held to the same length with min_new_tokens). Tokens/s = response tokens / time of
the second call (the first warms up).

Train step: `ActorTrainer.train_step` (what `rlx train-step` runs) on the batch `rlx score` wrote for the native
rollouts: packed micro-batches with 3-D positions, varlen attention, fused logprobs, vision tower frozen (the
default; --train-tower trains it); against the same samples in padded micro-batches of --baseline-rows rows,
`model(input_ids, attention_mask, pixel_values, image_grid_thw).logits`, float32 log-softmax on the response,
backward, clip, AdamW. Tokens/s = (prompt + response tokens) / median step time after a warm-up step. On CUDA
also `train_rlx_fast_path`: the train step as `rlx ppo` runs it there (compiled decoder layers, micro-batches of
--train-budget tokens).

Score: the old-logprob forward of `rlx score` over the same rollouts with their images, in packed rows of
--score-budget tokens against padded micro-batches of --baseline-rows rows (median of --steps after a warm-up).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

QWEN2_VL_2B_TEXT = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
)  # fmt: skip
QWEN2_VL_2B_VISION = dict(
    depth=32, embed_dim=1280, hidden_size=1536, mlp_ratio=4, num_heads=16, patch_size=14, spatial_merge_size=2,
    temporal_patch_size=2,
)  # fmt: skip
LENGTH_REWARD = "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"


def write_model_dir(folder: Path, small: bool) -> Path:
    """config.json + tokenizer + preprocessor_config.json (no weights) of the benchmark model."""
    from rlx.models.vision.processor import VisionProcessor
    from rlx.models.vision.tiny import family_by_name, tiny_vision_tokenizer, write_tiny_vision_model_dir

    if small:
        return write_tiny_vision_model_dir(folder, "qwen2_vl")
    family = family_by_name("qwen2_vl")
    tokenizer = tiny_vision_tokenizer(family)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in family.special_tokens}
    text = dict(QWEN2_VL_2B_TEXT, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    config = family.load_config_class()(
        text_config=text, vision_config=QWEN2_VL_2B_VISION, image_token_id=ids[family.image_token],
        video_token_id=ids[family.extra_tokens[0]], tie_word_embeddings=True,
        **{family.start_token_key: ids[family.image_start], family.end_token_key: ids[family.image_end]},
    )  # fmt: skip
    config.architectures = [family.model_class]
    image_processor = family.load_image_processor_class()(
        patch_size=14, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": 56 * 56, "longest_edge": 448 * 448},
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    VisionProcessor(family, image_processor, tokenizer).save_pretrained(folder)
    return folder


def write_prompts(path: Path, count: int, size: int) -> Path:
    from rlx.tasks.shapes import generate_shapes, write_shapes

    write_shapes(path, generate_shapes(count, seed=0, size=size, grid=6, max_count=4), embed=True)
    return path


def rlx(*args) -> None:
    subprocess.run([sys.executable, "-m", "rlx", *map(str, args)], check=True)


def time_call(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def rlx_rollout(ckpt: Path, prompts: Path, args, device, engine: str) -> tuple[dict, list]:
    """(tokens/s of the second generate call, its records) of one rlx engine."""
    from rlx.checkpoints.loading import load_model, load_processor
    from rlx.formats.records import read_prompts
    from rlx.models.loading import load_tokenizer, resolve_source
    from rlx.parallel.dist import DistContext
    from rlx.rollout.base import build_engine
    from rlx.rollout.config import RolloutConfig, SamplingParams
    from rlx.rollout.registry import engine_class

    cfg = RolloutConfig(
        engine=engine,
        batch_size=args.prompts * args.n,
        device=device.type,
        sampling=SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, seed=1),
    )
    source = resolve_source(str(ckpt))
    model = load_model(source, dtype=engine_class(engine).model_dtype(cfg, device))
    built = build_engine(cfg, model, load_tokenizer(source), DistContext(device=device), load_processor(source))
    records = read_prompts(str(prompts))
    built.generate(records, cfg.sampling, progress=False)  # warm-up: graphs, caches, kernels
    result = built.generate(records, cfg.sampling, progress=False)
    return {"tokens": result.stats.tokens, "seconds": result.stats.seconds,
            "tokens_per_s": result.stats.tokens_per_s}, result.records  # fmt: skip


def padded_prompts(processor, records, rows: range, device, dtype):
    """Left-padded input ids, mask and the images of prompt records `rows` (transformers' own batch form)."""
    from rlx.models.vision.inputs import VisionInputs

    encoded = [processor.encode(records[i].prompt, prompt_id=records[i].id) for i in rows]
    width = max(len(e.input_ids) for e in encoded)
    pad = processor.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(e.input_ids)) + e.input_ids for e in encoded], device=device)
    mask = torch.tensor([[0] * (width - len(e.input_ids)) + [1] * len(e.input_ids) for e in encoded], device=device)
    vision = VisionInputs.concat([e.vision for e in encoded]).to(device, dtype)
    # transformers computes the mRoPE positions from the image tokens' places
    return ids, mask, {**vision.model_kwargs(), "mm_token_type_ids": (ids == processor.image_token_id).int()}


def hf_generate(ckpt: Path, prompts: Path, args, device, dtype) -> dict:
    """transformers' `generate` on padded batches of --baseline-rows prompts, each sampled n times."""
    from rlx.checkpoints.loading import load_model, load_processor
    from rlx.formats.records import read_prompts
    from rlx.models.loading import resolve_source

    source = resolve_source(str(ckpt))
    model = load_model(source, dtype=dtype).to(device).eval()
    processor, records = load_processor(source), read_prompts(str(prompts))
    records = [r for r in records for _ in range(args.n)]
    batches = [padded_prompts(processor, records, range(i, min(i + args.baseline_rows, len(records))), device, dtype)
               for i in range(0, len(records), args.baseline_rows)]  # fmt: skip

    def run():
        for ids, mask, images in batches:
            model.generate(input_ids=ids, attention_mask=mask, **images, max_new_tokens=args.max_new_tokens,
                           min_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0, top_k=0,
                           top_p=1.0)  # fmt: skip

    with torch.no_grad():
        time_call(run, device)
        seconds = time_call(run, device)
    tokens = len(records) * args.max_new_tokens
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def rlx_train(ckpt: Path, batch_path: Path, args, device, fast_path: bool = False) -> dict:
    """Median `ActorTrainer.train_step` time (the code `rlx train-step` runs) over --steps steps after a warm-up;
    `fast_path`: as `rlx ppo` trains on CUDA (compiled decoder layers, micro-batches of --train-budget tokens)."""
    from rlx.backends.registry import backend_for_checkpoint, checkpoint_degrees
    from rlx.checkpoints.loading import load_processor
    from rlx.checkpoints.registry import check_complete
    from rlx.formats.batch import TrainBatch
    from rlx.models.loading import load_config, resolve_source
    from rlx.models.vision.config import VisionConfig
    from rlx.training.config import OptimConfig, TrainConfig

    fast = dict(compile=True, max_tokens_per_micro_batch=args.train_budget) if fast_path else {}
    cfg = TrainConfig(optim=OptimConfig(lr=1e-6), micro_batch_size=args.baseline_rows, use_packing=True,
                      device=device.type, vision=VisionConfig(freeze_vision_tower=not args.train_tower),
                      **fast)  # fmt: skip
    source = resolve_source(str(ckpt), "checkpoint")
    meta = check_complete(source.path)
    batch = TrainBatch.load(str(batch_path), load_processor(source, cfg.vision, load_config(source)))
    backend = backend_for_checkpoint(meta).setup(cfg.device, checkpoint_degrees(meta, 1))
    trainer = backend.load_trainer(cfg, source, load_config(source))
    times = []
    for step in range(args.steps + 1):
        metrics = {}
        seconds = time_call(lambda: metrics.update(trainer.train_step(batch, step)), device)  # noqa: B023
        times.append(seconds)
    tokens = float(batch.prompt_mask.sum() + batch.response_mask.sum())
    median = statistics.median(times[1:])
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    trainer = None  # the next measurement gets the memory back
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return {"tokens": tokens, "median_s": median, "tokens_per_s": tokens / median, "peak_gib": peak}


def rlx_score(ckpt: Path, rollouts_path: Path, args, device, dtype, packed: bool) -> dict:
    """Median time of the old-logprob forward `rlx score` runs over the rollouts with their images: packed rows of
    --score-budget tokens (the fast path's default), or padded micro-batches of --baseline-rows rows."""
    from rlx.checkpoints.loading import load_model, load_processor
    from rlx.formats.batch import collate
    from rlx.formats.images import rollout_images
    from rlx.formats.records import read_rollouts
    from rlx.logprobs import ModuleScorer
    from rlx.models.loading import load_config, resolve_source
    from rlx.models.vision.config import VisionConfig
    from rlx.parallel.dist import DistContext

    source = resolve_source(str(ckpt), "checkpoint")
    rollouts = read_rollouts(rollouts_path)
    images = rollout_images(rollouts, load_processor(source, VisionConfig(), load_config(source)), load_config(source))
    tensors = collate(rollouts, 0)
    scorer = ModuleScorer(load_model(source).to(device), DistContext(device=device))
    budget = args.score_budget if packed else 0
    times = [
        time_call(
            lambda: scorer.logprobs(tensors, 1.0, dtype, args.baseline_rows, max_tokens=budget, vision=images.vision),
            device,
        )  # fmt: skip
        for _ in range(args.steps + 1)
    ]
    tokens = float(tensors["prompt_mask"].sum() + tensors["response_mask"].sum())
    median = statistics.median(times[1:])
    return {"tokens": tokens, "median_s": median, "tokens_per_s": tokens / median}


def hf_train(ckpt: Path, batch_path: Path, args, device, dtype) -> dict:
    """The same samples as padded micro-batches through transformers' own forward, backward, clip and AdamW."""
    from rlx.checkpoints.loading import load_model, load_processor
    from rlx.formats.batch import TrainBatch
    from rlx.models.loading import load_config, resolve_source
    from rlx.models.vision.families import freeze_vision_tower

    source = resolve_source(str(ckpt), "checkpoint")
    batch = TrainBatch.load(str(batch_path), load_processor(source, None, load_config(source)))
    model = load_model(source, dtype=torch.float32).to(device).train()
    freeze_vision_tower(model, not args.train_tower)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    vision, b, r = batch.images.vision, len(batch.response_ids), batch.response_ids.shape[1]

    def step():
        for lo in range(0, b, args.baseline_rows):
            rows = list(range(lo, min(lo + args.baseline_rows, b)))
            response, response_mask = batch.response_ids[rows].to(device), batch.response_mask[rows].to(device)
            # a sampled image placeholder is text to rlx; transformers' forward would count it as an image token
            # and refuse the row, so the baseline reads the pad id there (same shapes, same work)
            text = response.masked_fill(response == model.config.image_token_id, batch.meta.pad_token_id)
            ids = torch.cat([batch.prompt_ids[rows].to(device), text], 1)
            mask = torch.cat([batch.prompt_mask[rows].to(device), response_mask], 1)
            images = vision.select(rows).to(device).model_kwargs()
            images["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(input_ids=ids, attention_mask=mask, **images, use_cache=False).logits[:, -r - 1 : -1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, response[..., None])[..., 0]
            loss = -(logp * response_mask).sum() / batch.response_mask.sum()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = [time_call(step, device) for _ in range(args.steps + 1)]
    tokens = float(batch.prompt_mask.sum() + batch.response_mask.sum())
    median = statistics.median(times[1:])
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return {"tokens": tokens, "median_s": median, "tokens_per_s": tokens / median, "peak_gib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny Qwen2-VL (a quick check of the script)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (float32)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per call (default 32)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="response length (default 128)")
    parser.add_argument("--baseline-rows", type=int, default=8, help="rows per padded transformers batch (8)")
    parser.add_argument("--steps", type=int, default=3, help="timed train steps after a warm-up (default 3)")
    parser.add_argument("--train-tower", action="store_true", help="train the vision tower too (default frozen)")
    parser.add_argument(
        "--score-budget",
        type=int,
        default=15360,
        help="tokens per packed scoring row (default 15360, the fast path's for this shape)",
    )
    parser.add_argument("--train-budget", type=int, default=8192, help="tokens per micro-batch of the fast-path "
                        "train step (default 8192, recipes/qwen2_vl_2b_shapes.toml's)")  # fmt: skip
    parser.add_argument("--no-generate-baselines", action="store_true", help="skip the hf engine and transformers "
                        "generate rollouts (the slow part)")  # fmt: skip
    parser.add_argument("--rollout-engines", default="native", help="comma-separated rlx engines whose rollouts "
                        "are timed, each after a warm-up call: native, vllm, hf (default native)")  # fmt: skip
    parser.add_argument("--rollout-only", action="store_true", help="stop after the rollouts (no baselines, no "
                        "scoring or training)")  # fmt: skip
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_model_dir(root / "model", args.small)
        rlx("shard", "--model", model_dir, "--init", "random", "--seed", "0", "--out", root / "ckpt")
        prompts = write_prompts(root / "prompts.jsonl", args.prompts, 448)
        records = None
        for engine in args.rollout_engines.split(","):
            timed, engine_records = rlx_rollout(root / "ckpt", prompts, args, device, engine)
            report(results, f"rollout_{engine}", timed)
            records = records or engine_records
        if args.rollout_only:
            finish(results, args)
            return
        if not args.no_generate_baselines:
            report(results, "rollout_hf_engine", rlx_rollout(root / "ckpt", prompts, args, device, "hf")[0])
            report(results, "rollout_transformers_generate", hf_generate(root / "ckpt", prompts, args, device, dtype))
        from rlx.formats.records import write_records

        write_records(root / "rollouts.jsonl", records)
        (root / "reward.py").write_text(LENGTH_REWARD)
        rlx("score", "--rollouts", root / "rollouts.jsonl", "--actor", root / "ckpt", "--reward",
            f"{root / 'reward.py'}:score", "--out", root / "scored")  # fmt: skip
        for mode in ("packed", "padded"):
            scored = rlx_score(root / "ckpt", root / "rollouts.jsonl", args, device, dtype, mode == "packed")
            report(results, f"score_rlx_{mode}", scored)
        batch = root / "scored" / "batch.safetensors"
        report(results, "train_rlx", rlx_train(root / "ckpt", batch, args, device))
        if device.type == "cuda":
            report(results, "train_rlx_fast_path", rlx_train(root / "ckpt", batch, args, device, fast_path=True))
        report(results, "train_transformers_padded", hf_train(root / "ckpt", batch, args, device, dtype))
    finish(results, args)


def finish(results: dict, args) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def report(results: dict, key: str, result: dict) -> None:
    """Keep one measurement and print it at once (a later failure does not lose it)."""
    results[key] = result
    print(f"{key:32s} {result['tokens_per_s']:12.1f} tokens/s  {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    main()
