"""The `native` rollout engine: continuous batching over a paged KV cache with the model rlx holds.

The same contract and the same random draws as the hf engine (per-sample streams from sampling.py,
indexed by token position), so for a seed both engines sample the same tokens up to floating-point
differences in the logits; greedy decoding gives the same tokens. Sequences are scheduled
continuously (scheduler.py): a finished sequence's slot is refilled by the next prefill, the N samples
of a prompt share the cache blocks of its prefix (blocks.py), and the KV cache is sized from free
device memory (that fraction of it: `rollout.gpu_memory_utilization`; `rollout.kv_cache_gib` on the
CPU or to fix it). The cache and the decode CUDA graphs are kept from one `generate` call to the next
until `sleep()`, which `rlx ppo` calls after each rollout so the trainer has the memory.

A vision-language model runs its vision tower once per prompt with images and takes the image embeddings and
3-D mRoPE positions in the prefill; decode steps rotate at the text position plus the sequence's mRoPE offset
(vision.py). Its tokens and logprobs equal the hf engine's as for text models.

Host and device overlap (as vLLM's async scheduling): after a decode step is queued, the next decode step
is planned from lengths alone and queued before the host reads the first one's tokens (its input tokens are
gathered on the device), so the device computes step t+1 while the host does step t's bookkeeping. A
sequence that stopped at step t (EOS) then has one extra token computed at t+1, which is discarded. Prefill
steps, preemption and a due prefill go through the synchronous path. rollout.overlap = false turns it off.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import record_function
from tqdm import tqdm

from rlx.engine.rollout.base import LocalGeneration, RolloutEngine, WeightSource, copy_weights
from rlx.engine.rollout.config import SamplingParams
from rlx.engine.rollout.native.blocks import BlockManager, Sequence, Status
from rlx.engine.rollout.native.replica import build_replica, fill_merged_replica, fill_replica, is_sharded
from rlx.engine.rollout.native.runner import ModelRunner
from rlx.engine.rollout.native.sampler import Launched, StepSampler
from rlx.engine.rollout.native.scheduler import Scheduler
from rlx.engine.rollout.native.vision import NativeImages
from rlx.engine.rollout.requests import Generated, Request
from rlx.engine.rollout.sampling import sample_uniforms
from rlx.engine.rollout.stops import StopStrings
from rlx.errors import UserError
from rlx.models.lora import is_lora_model
from rlx.models.vision.families import is_vision_config
from rlx.utils.device import resolve_precision

_GIB = 1 << 30
_HEADROOM = 8  # a new KV cache gets 1/8 more blocks than the call needs (prompt lengths vary per step)


class NativeRolloutEngine(RolloutEngine):
    """Generates with `model` itself (no copy of its weights; an FSDP-sharded model through a replica gathered
    from its shards, see replica.py) through a paged KV cache."""

    name = "native"
    takes_images = True

    def __init__(self, model, tokenizer, cfg, ctx, processor=None):
        super().__init__(model.to(ctx.device), tokenizer, cfg, ctx, processor)
        self.sharded = is_sharded(self.model)
        # a LoRA policy: decode with a plain replica of the merged weights, or with the adapters (rollout.lora_rollout)
        self.merges = is_lora_model(self.model) and cfg.lora_rollout == "merged"
        # a replica in the rollout dtype (bf16 on GPUs) when the model is sharded, holds other weights (a trainer's
        # float32 master weights) or is merged: filled in place after each update, so the decode graphs keep
        # pointing at it
        self.use_replica = self.sharded or self.merges or _param_dtype(self.model) != self.dtype
        self._replica: torch.nn.Module | None = None
        self._replica_fresh = False
        self._replica_filled = False  # a merged replica holds the frozen weights (written once)
        self.block_size = cfg.block_size
        self._runner: ModelRunner | None = None
        self._capped = False  # whether the cache was cut to the memory budget (then reused whatever it holds)
        self.cache_builds = 0  # KV caches (with their decode graphs) allocated so far: kept across calls when they fit
        self.replica_fills = 0  # times the replica was refilled from the model's weights
        self._num_ahead = 0

    @classmethod
    def model_dtype(cls, cfg, device: torch.device) -> torch.dtype:
        """The rollout dtype itself: a model the engine owns needs no replica."""
        return resolve_precision(cfg.precision, device)

    def counters(self) -> dict[str, float]:
        return {"cache_builds": self.cache_builds, "replica_fills": self.replica_fills, "cache_capped": self._capped}

    def sleep(self) -> float:
        """With rollout.sleep (off by default for this engine: its cache is sized by what the rollouts need), free
        the KV cache, the decode CUDA graphs and the replica so the trainer has the memory; returns the bytes
        released. Kept, they serve the next rollout as they are."""
        if not self.cfg.sleep:
            return 0.0
        freed = 0
        if self._runner is not None:
            freed += sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in self._runner.kv)
            self._runner = None
        if self._replica is not None:
            freed += sum(p.untyped_storage().nbytes() for p in self._replica.parameters())
            self._replica, self._replica_fresh = None, False
        if freed and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return float(freed)

    def update_weights(self, source: WeightSource) -> float:
        """The live module needs no copy; other weights are copied into the engine's model in place. A replica is
        refilled (in place, in the rollout dtype) before the next rollout."""
        start = time.perf_counter()
        if source.module is not self.model:
            copy_weights(self.model, source.named_weights(self.cfg.sync_bucket_mib << 20))
        self._replica_fresh = False
        return time.perf_counter() - start

    def _free_runner(self) -> None:
        if self._runner is not None:
            self._runner = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _generating_module(self) -> torch.nn.Module:
        """The model itself, or its replica in the rollout dtype (a merged LoRA one: the adapters merged in), filled
        with the current weights when they changed (a collective for a sharded model: every rank calls it)."""
        if not self.use_replica:
            return self.model
        if self._replica is None:
            adapters = is_lora_model(self.model) and not self.merges
            self._replica = build_replica(self.model, self.device, self.dtype, adapters)
            self._replica_filled = False
        if not self._replica_fresh:
            if self.merges:
                fill_merged_replica(self._replica, self.model, include_frozen=not self._replica_filled)
            else:
                fill_replica(self._replica, self.model)
            self._replica_fresh = self._replica_filled = True
            self.replica_fills += 1
        return self._replica

    def _num_blocks(self, seqs: list[Sequence]) -> int:
        """Blocks for every sequence at its longest (no preemption) with headroom, so that the next call's slightly
        longer prompts still fit, or what the memory budget allows if fewer."""
        budget, needed = self._budget_blocks(), self._needed(seqs)
        self._capped = budget < needed
        return min(needed + needed // _HEADROOM, budget)

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

    def generate_local(self, requests: list[Request], sampling: SamplingParams, progress: bool) -> LocalGeneration:
        """This process's requests, continuously batched through the paged cache at the process's own pace."""
        uniforms = sample_uniforms(sampling.seed, [r.sample_id for r in requests], sampling.max_new_tokens)
        seqs = [
            Sequence(i, r.prompt_ids, sampling.max_new_tokens, greedy=r.greedy or sampling.temperature == 0)
            for i, r in enumerate(requests)
        ]
        module = self._generating_module()  # before the cache is sized from the free memory
        was_training = module.training
        module.eval()
        images = NativeImages(module, requests, seqs) if is_vision_config(module.config) else None
        runner = self._runner_for(module, seqs)
        runner.images = images  # this call's images (vision.py)
        scheduler = Scheduler(runner.blocks, self.cfg.max_num_seqs, self.cfg.max_prefill_tokens)
        for seq in seqs:
            try:
                scheduler.add(seq)
            except ValueError as e:
                raise UserError(f"request {requests[seq.index].sample_id}: {e}; raise rollout.kv_cache_gib") from None
        show = progress and (self.ctx is None or self.ctx.is_main)
        bar = tqdm(total=len(seqs), desc="rollout", unit="seq", disable=None if show else True, leave=False)
        self._num_ahead = 0
        self._stops = StopStrings(self.tokenizer, sampling.stop) if sampling.stop else None
        try:
            sampler = StepSampler(uniforms, sampling, self.cfg.max_num_seqs, self.device)
            self._run_steps(runner, scheduler, sampler, bar)
        finally:
            bar.close()
            module.train(was_training)
        generated = [Generated(s.output_ids, s.logprobs, s.finish_reason) for s in seqs]
        return LocalGeneration(generated, preemptions=scheduler.preemptions, steps_ahead=self._num_ahead)

    def _runner_for(self, module: torch.nn.Module, seqs: list[Sequence]) -> ModelRunner:
        """The KV cache (and decode graphs) of the last call when they fit these sequences, else new ones;
        the block manager always starts empty."""
        longest = max((len(s.prompt_ids) + s.max_tokens for s in seqs), default=1)
        width = -(-longest // self.block_size)
        cfg = self.cfg
        graphs = min(cfg.max_num_seqs, len(seqs)) if cfg.cuda_graphs else 0  # only the batch sizes this call can use
        old = self._runner
        if (
            old is not None
            and old.model is module
            and old.max_blocks >= width
            and (old.max_batch >= graphs or not old.graphs)
            and (self._capped or old.blocks.num_blocks >= self._needed(seqs))
        ):
            old.blocks = BlockManager(old.blocks.num_blocks, self.block_size)
            return old
        self._free_runner()  # free the old cache before measuring the memory for the new one
        blocks = BlockManager(self._num_blocks(seqs), self.block_size)
        self.cache_builds += 1
        width += 1 + width // _HEADROOM  # block-table room for longer prompts next time
        self._runner = ModelRunner(
            module, self.device, self.dtype, blocks, width, graphs, cfg.compile, cfg.paged_attention
        )
        return self._runner

    def _run_steps(self, runner: ModelRunner, scheduler: Scheduler, sampler: StepSampler, bar) -> None:
        """Run steps until every sequence finished; a decode step's successor is queued before its tokens are
        read where the scheduler can plan it from lengths alone."""
        overlap = self.cfg.overlap
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
            stopped = token in self.stop_ids or (self._stops is not None and self._stops.hit(seq.output_ids))
            if stopped or len(seq.output_ids) >= seq.max_tokens:
                scheduler.finish(seq, "stop" if stopped else "length")
                finished += 1
        return finished


def _param_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point parameters."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
