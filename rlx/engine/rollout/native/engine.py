"""The `native` rollout engine: continuous batching over a paged KV cache with the model rlx holds.

The same contract and the same random draws as the hf engine (per-sample streams from sampling.py,
indexed by token position), so for a seed both engines sample the same tokens up to floating-point
differences in the logits; greedy decoding gives the same tokens. Sequences are scheduled
continuously (scheduler.py): a finished sequence's slot is refilled by the next prefill, the N samples
of a prompt share the cache blocks of its prefix (blocks.py), and the KV cache is sized from free
device memory (that fraction of it: `rollout.gpu_memory_utilization`; `rollout.kv_cache_gib` on the
CPU or to fix it). The cache and the decode CUDA graphs are kept from one `generate` call to the next
until `sleep()`, which `rlx ppo` calls after each rollout so the trainer has the memory.

Host and device overlap (as vLLM's async scheduling): after a decode step is queued, the next decode step
is planned from lengths alone and queued before the host reads the first one's tokens (its input tokens are
gathered on the device), so the device computes step t+1 while the host does step t's bookkeeping. A
sequence that stopped at step t (EOS) then has one extra token computed at t+1, which is discarded. Prefill
steps, preemption and a due prefill go through the synchronous path. RLX_NATIVE_OVERLAP=0 turns it off.
"""

from __future__ import annotations

import os
import time

import torch
from torch.profiler import record_function
from tqdm import tqdm

from rlx.engine.parallel.dist import all_gather_objects, shard_range
from rlx.engine.records import PromptRecord, RolloutRecord
from rlx.engine.rollout.config import RolloutConfig
from rlx.engine.rollout.native.blocks import BlockManager, Sequence, Status
from rlx.engine.rollout.native.replica import build_replica, fill_replica, is_sharded
from rlx.engine.rollout.native.runner import ModelRunner
from rlx.engine.rollout.native.sampler import Launched, StepSampler
from rlx.engine.rollout.native.scheduler import Scheduler
from rlx.engine.rollout.prompts import stop_token_ids
from rlx.engine.rollout.requests import Generated, build_requests, to_record
from rlx.engine.rollout.sampling import sample_uniforms
from rlx.errors import UserError

_GIB = 1 << 30


class NativeRolloutEngine:
    """Generates with `model` itself (no copy of its weights; an FSDP-sharded model through a replica gathered
    from its shards at each `generate`, see replica.py) through a paged KV cache."""

    def __init__(self, model, tokenizer, device: torch.device, dtype: torch.dtype, cfg: RolloutConfig, ctx=None):
        self.model, self.tokenizer, self.device, self.dtype, self.cfg = model, tokenizer, device, dtype, cfg
        self.sharded = is_sharded(model)  # FSDP: generate with a replica gathered from the shards (replica.py)
        self._replica: torch.nn.Module | None = None
        self.ctx = ctx if ctx is not None and ctx.distributed else None
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.block_size = cfg.block_size
        self.last_stats: dict[str, float] = {}
        self._runner: ModelRunner | None = None
        self._num_ahead = 0

    def sleep(self) -> float:
        """Free the KV cache and CUDA graphs kept from the last `generate`, and the gathered replica of a sharded
        model (the trainer gets the memory); returns the bytes released."""
        freed = 0
        if self._runner is not None:
            freed += sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in self._runner.kv)
            self._runner = None
        if self._replica is not None:
            freed += sum(p.untyped_storage().nbytes() for p in self._replica.parameters())
            self._replica = None
        if freed and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return float(freed)

    def _free_runner(self) -> None:
        if self._runner is not None:
            self._runner = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _generating_module(self) -> torch.nn.Module:
        """The model itself, or for an FSDP-sharded one its replica, filled with the current weights (all ranks)."""
        if not self.sharded:
            return self.model
        if self._replica is None:
            self._replica = build_replica(self.model, self.device, self.dtype)
        fill_replica(self._replica, self.model)
        return self._replica

    def wake(self, model=None, path=None) -> float:
        """Nothing to refresh: the engine generates with the trainer's own module (or gathers its shards)."""
        return 0.0

    def close(self) -> None:
        """Nothing to shut down."""

    def _num_blocks(self, seqs: list[Sequence]) -> int:
        """On CUDA, what the memory budget allows (kept across calls); elsewhere blocks for every sequence
        at its longest, or what the budget allows if fewer."""
        if self.device.type == "cuda" and not self.cfg.kv_cache_gib:
            return self._budget_blocks()
        return min(self._needed(seqs), self._budget_blocks())

    def _needed(self, seqs: list[Sequence]) -> int:
        return 1 + sum(-(-(len(s.prompt_ids) + s.max_tokens) // self.block_size) for s in seqs)

    def _budget_blocks(self) -> int:
        per_block = ModelRunner.bytes_per_block(self.model.config, self.block_size, self.dtype)
        if self.cfg.kv_cache_gib:
            budget = self.cfg.kv_cache_gib * _GIB
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * self.cfg.gpu_memory_utilization
        else:
            budget = 1 * _GIB
        if budget < 2 * per_block:
            raise UserError(
                f"no room for a KV cache ({budget / _GIB:.2f} GiB): raise rollout.gpu_memory_utilization or "
                f"set rollout.kv_cache_gib"
            )
        return int(budget // per_block)

    def generate(self, prompts: list[PromptRecord], cfg: RolloutConfig, progress: bool = True) -> list[RolloutRecord]:
        """N responses per prompt, in prompt order then sample order."""
        requests = build_requests(prompts, self.tokenizer, cfg)
        local = shard_range(len(requests), self.ctx.rank, self.ctx.world) if self.ctx else range(len(requests))
        mine = [requests[i] for i in local]
        uniforms = sample_uniforms(cfg.seed, [r.sample_id for r in mine], cfg.max_new_tokens)
        seqs = [
            Sequence(i, r.prompt_ids, cfg.max_new_tokens, greedy=r.greedy or cfg.temperature == 0)
            for i, r in enumerate(mine)
        ]
        start = time.perf_counter()
        module = self._generating_module()  # before the cache is sized from the free memory
        was_training = module.training
        module.eval()
        runner = self._runner_for(module, seqs, cfg)
        blocks = runner.blocks
        scheduler = Scheduler(blocks, cfg.max_num_seqs, cfg.max_prefill_tokens)
        for seq in seqs:
            try:
                scheduler.add(seq)
            except ValueError as e:
                raise UserError(f"request {mine[seq.index].sample_id}: {e}; raise rollout.kv_cache_gib") from None
        show = progress and (self.ctx is None or self.ctx.is_main)
        bar = tqdm(total=len(seqs), desc="rollout", unit="seq", disable=None if show else True, leave=False)
        self._num_ahead = 0
        try:
            self._run_steps(runner, scheduler, StepSampler(uniforms, cfg, self.device), bar)
        finally:
            bar.close()
            module.train(was_training)
        results = [Generated(s.output_ids, s.logprobs, s.finish_reason) for s in seqs]
        generated = sum(len(s.output_ids) for s in seqs)
        if self.ctx:
            results = [g for part in all_gather_objects(results) for g in part]
            generated = sum(len(g.response_ids) for g in results)
        seconds = time.perf_counter() - start
        self.last_stats = {
            "rollout/tokens": float(generated),
            "timing/generate_s": seconds,
            "perf/rollout_tokens_per_s": generated / max(seconds, 1e-9),
            "rollout/preemptions": float(scheduler.preemptions),
            "rollout/steps_ahead": float(self._num_ahead),
        }
        return [to_record(r, g, self.tokenizer, cfg.temperature) for r, g in zip(requests, results)]

    def _runner_for(self, module: torch.nn.Module, seqs: list[Sequence], cfg: RolloutConfig) -> ModelRunner:
        """The KV cache (and decode graphs) of the last call when they fit these sequences, else new ones;
        the block manager always starts empty."""
        longest = max((len(s.prompt_ids) + s.max_tokens for s in seqs), default=1)
        width = -(-longest // self.block_size)
        graphs = cfg.max_num_seqs if cfg.cuda_graphs else 0
        old = self._runner
        budget_sized = self.device.type == "cuda" and not self.cfg.kv_cache_gib
        if (
            old is not None
            and old.model is module
            and old.max_blocks >= width
            and old.max_batch == graphs
            and (budget_sized or old.blocks.num_blocks >= self._needed(seqs))
        ):
            old.blocks = BlockManager(old.blocks.num_blocks, self.block_size)
            return old
        self._free_runner()  # free the old cache before measuring the memory for the new one
        blocks = BlockManager(self._num_blocks(seqs), self.block_size)
        self._runner = ModelRunner(module, self.device, self.dtype, blocks, width, graphs)
        return self._runner

    def _run_steps(self, runner: ModelRunner, scheduler: Scheduler, sampler: StepSampler, bar) -> None:
        """Run steps until every sequence finished; a decode step's successor is queued before its tokens are
        read where the scheduler can plan it from lengths alone."""
        overlap = os.environ.get("RLX_NATIVE_OVERLAP", "1") != "0"
        inflight: Launched | None = None
        while inflight is not None or not scheduler.done:
            launched = None
            if inflight is not None and inflight.decode and overlap:
                with record_function("rlx/schedule"):
                    ahead = scheduler.schedule_ahead(inflight.seqs)
                if ahead is not None:
                    self._num_ahead += 1
                    row_of = {seq: row for row, seq in enumerate(inflight.seqs)}
                    prev = (inflight.tokens, [row_of[seq] for seq in ahead.seqs])
                    launched = self._launch(runner, sampler, ahead.seqs, True, prev)
            elif inflight is None:
                with record_function("rlx/schedule"):
                    step = scheduler.schedule()
                launched = self._launch(runner, sampler, step.seqs, step.kind == "decode", None)
            if inflight is not None:
                with record_function("rlx/finish"):
                    bar.update(self._finish(inflight, sampler, scheduler))
            inflight = launched

    @staticmethod
    def _launch(runner: ModelRunner, sampler: StepSampler, seqs: list[Sequence], decode: bool, prev) -> Launched:
        with record_function("rlx/decode" if decode else "rlx/prefill"):
            logits = runner.forward(seqs, decode=decode, prev=prev)
        with record_function("rlx/sample"):
            return sampler.launch(seqs, logits, decode, ahead=prev is not None)

    def _finish(self, step: Launched, sampler: StepSampler, scheduler: Scheduler) -> int:
        """Append each sequence's sampled token, finish stopped sequences; returns how many finished."""
        tokens, logprobs = sampler.collect(step)
        finished = 0
        for seq, token, logprob in zip(step.seqs, tokens, logprobs):
            if seq.status is not Status.RUNNING:
                continue  # it stopped at the step before: this token was computed ahead and is discarded
            seq.num_computed = len(seq)
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            if token in self.stop_ids or len(seq.output_ids) >= seq.max_tokens:
                scheduler.finish(seq, "stop" if token in self.stop_ids else "length")
                finished += 1
        return finished
