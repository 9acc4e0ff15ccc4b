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
steps, preemption and a due prefill go through the synchronous path. rollout.native.overlap = false turns it off.

Everything runs through a stream (`open_stream`): `generate` submits its requests at once, multi-turn episodes
and served agents submit each turn when its context is ready, and it joins the running batch at the next
prefill while the others keep decoding. A turn's context begins with the sample's earlier turns, whose full
blocks stay cached after they finish (blocks.py), so only the new tokens are prefilled.

With rollout.tp_degree = K > 1 (under torchrun) K consecutive ranks run one engine: each decodes with its slice of
every layer's heads and MLP and its key/value heads' share of the cache, the partial sums all-reduced twice a layer
(tensor_parallel.py); the group shares one slice of the requests and, computing the same logits, samples the same
tokens on every rank. Multi-turn episodes run on the group's first rank, whose stream the others mirror (mirror.py).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Collection

import numpy as np
import torch
from torch.profiler import record_function

from rlx.errors import UserError
from rlx.models.family import family_of
from rlx.models.lora import is_lora_model
from rlx.parallel.dist import TensorParallelGroup, all_reduce, shard_range, tensor_parallel_group
from rlx.rollout.base import RolloutEngine, TokenStream, WeightSource, copy_weights, teacher_forced
from rlx.rollout.config import SamplingParams
from rlx.rollout.mirror import open_mirrored
from rlx.rollout.native.blocks import BlockManager, Sequence, Status
from rlx.rollout.native.cohort import Cohort
from rlx.rollout.native.fused import merge_projections
from rlx.rollout.native.replica import build_replica, fill_merged_replica, fill_replica, is_sharded
from rlx.rollout.native.runner import ModelRunner
from rlx.rollout.native.sampler import Launched, StepSampler
from rlx.rollout.native.scheduler import Scheduler
from rlx.rollout.native.tensor_parallel import add_row_parallel_reduce, check_splittable, rank_slice, sliced_config
from rlx.rollout.native.vision import NativeImages
from rlx.rollout.requests import Generated, PromptLogprobs, TokenRequest
from rlx.rollout.sampling import request_uniforms
from rlx.rollout.stops import StopStrings
from rlx.utils import vmm
from rlx.utils.device import resolve_precision
from rlx.utils.vmm import VirtualBuffer

_GIB = 1 << 30
_HEADROOM = 8  # a new KV cache gets 1/8 more blocks than the call needs (prompt lengths vary per step)


class NativeRolloutEngine(RolloutEngine):
    """Generates with `model` itself (no copy of its weights; an FSDP-sharded model through a replica gathered
    from its shards, see replica.py) through a paged KV cache."""

    name = "native"
    gives_top_logprobs = True
    gives_prompt_logprobs = True
    takes_constraints = True
    takes_images = True

    def __init__(self, model, tokenizer, cfg, ctx, processor=None):
        # tensor parallel: the full model stays where it is (each rank's replica takes its slice from it); so does an
        # FSDP-sharded one (its replica is gathered from the shards, which CPU offload keeps on the CPU)
        self.tp = _tensor_parallel(model, cfg, ctx)
        self.stream_group = self.tp  # multi-turn episodes: the group's first rank submits, the others mirror it
        stays = self.tp is not None or is_sharded(model)
        super().__init__(model if stays else model.to(ctx.device), tokenizer, cfg, ctx, processor)
        self.rank_config = self.model.config if self.tp is None else sliced_config(self.model.config, self.tp.degree)
        """The config of the decoder this rank runs (a tensor-parallel rank's: its share of the heads and MLP)."""
        self.sharded = is_sharded(self.model)
        # a LoRA policy: decode with a plain replica of the merged weights, or with the adapters
        # (rollout.native.lora_rollout)
        self.merges = is_lora_model(self.model) and cfg.native.lora_rollout == "merged"
        # a replica in the rollout dtype (bf16 on GPUs) when the model is sharded, holds other weights (a trainer's
        # float32 master weights) or is merged: filled in place after each update, so the decode graphs keep
        # pointing at it
        self.use_replica = self.tp is not None or self.sharded or self.merges or _param_dtype(self.model) != self.dtype
        # exact mode generates with the trainer's parameter dtype under the same autocast (the trainer's arithmetic)
        self.replica_dtype = _param_dtype(self.model) if cfg.exact else self.dtype
        if cfg.exact:
            self.use_replica = self.sharded or self.merges
        if not self.use_replica and not any(p.requires_grad for p in self.model.parameters()):
            # a model nothing trains (no parameter requires grad): its q/k/v and gate/up weights become rows of merged
            # tensors (same Parameters, same values) and decode steps run one GEMM for each group (fused.py)
            merge_projections(self.model)
        self._replica: torch.nn.Module | None = None
        self._replica_memory: VirtualBuffer | None = None  # the replica's weights, when releasable
        self._replica_fresh = False
        # with rollout.sleep on a CUDA device with virtual memory management, the KV cache and the replica are
        # released at their addresses and taken back there (rlx.utils.vmm): the decode graphs are not captured again
        self.releasable = bool(cfg.sleep) and vmm.supported(self.device)
        self._replica_filled = False  # a merged replica holds the frozen weights (written once)
        self.block_size = cfg.native.block_size
        self._runner: ModelRunner | None = None
        self._capped = False  # whether the cache was cut to the memory budget (then reused whatever it holds)
        self.cache_builds = 0  # KV caches (with their decode graphs) allocated so far: kept across calls when they fit
        self.replica_fills = 0  # times the replica was refilled from the model's weights
        self.replica_fill_s = 0.0  # the last refill's time, device work included (the weight sync of a replica)

    @classmethod
    def model_dtype(cls, cfg, device: torch.device) -> torch.dtype:
        """The rollout dtype itself: a model the engine owns needs no replica (exact mode: float32, the trainer's
        parameters, computing under the rollout dtype's autocast as the trainer does)."""
        return torch.float32 if cfg.exact else resolve_precision(cfg.precision, device)

    def counters(self) -> dict[str, float]:
        replica = self._replica.parameters() if self._replica is not None else ()
        replica_gb = sum(t.numel() * t.element_size() for t in replica) / 2**30
        return {
            "cache_builds": self.cache_builds, "replica_fills": self.replica_fills, "cache_capped": self._capped,
            "replica_fill_s": self.replica_fill_s, "replica_gb": replica_gb,
        }  # fmt: skip

    def local_share(self, count: int) -> list[int]:
        """Tensor parallel: the ranks of a group share one slice of the requests (a contiguous slice per group)."""
        if self.tp is None:
            return super().local_share(count)
        return list(shard_range(count, self.tp.index, self.tp.count))

    def sleep(self) -> float:
        """With rollout.sleep (off by default for this engine: its cache is sized by what the rollouts need, and
        releasing costs time), free the KV cache and the replica so the trainer has the memory; returns the bytes
        released. On CUDA (virtual memory management) only their physical memory goes: the next rollout maps new
        memory at the same addresses and replays the decode graphs it has; elsewhere the graphs go too and are
        captured again. Kept, they serve the next rollout as they are."""
        if not self.cfg.sleep:
            return 0.0
        freed, dropped = 0, 0  # dropped: torch's memory (the caching allocator then returns it to the device)
        if self._runner is not None and self._runner.kv_memory is not None:
            freed += self._runner.release()
        elif self._runner is not None:
            dropped += sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in self._runner.kv)
            self._runner = None
        if self._replica_memory is not None:
            freed += self._replica_memory.release()
            self._replica_fresh = self._replica_filled = False
        elif self._replica is not None:
            dropped += sum(p.untyped_storage().nbytes() for p in self._replica.parameters())
            self._replica, self._replica_fresh = None, False
        if dropped and self.device.type == "cuda":
            torch.cuda.empty_cache()
        freed += dropped
        return float(freed)

    def update_weights(self, source: WeightSource) -> float:
        """The live module needs no copy; other weights are copied into the engine's model in place. A replica is
        refilled (in place, in the rollout dtype) before the next rollout."""
        start = time.perf_counter()
        if source.module is not self.model:
            copy_weights(self.model, source.named_weights(self.cfg.sync_bucket_mib << 20))
        self._replica_fresh = False
        return time.perf_counter() - start

    def close(self) -> None:
        """Drop a tensor-parallel engine's decode graphs: while a CUDA graph holding NCCL all-reduces is alive, the
        process group's teardown hangs (seen on two H100s; deleting the graphs first, it returns at once)."""
        if self.tp is not None and self._runner is not None:
            self._runner.graphs.clear()
            self._free_runner()

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
            self._replica, self._replica_memory = build_replica(
                self.model, self.device, self.replica_dtype, adapters, releasable=self.releasable,
                config=None if self.tp is None else self.rank_config,
            )  # fmt: skip
            if self.tp is not None:
                add_row_parallel_reduce(self._replica, self.tp.group)
            self._replica_filled = False
        if self._replica_memory is not None:
            self._replica_memory.restore()  # after a sleep: new memory at the same addresses, filled below
        if not self._replica_fresh:
            start = time.perf_counter()
            # a tensor-parallel rank keeps its slice of each parameter (gathered one at a time when sharded)
            take = {} if self.tp is None else {"take": functools.partial(rank_slice, **self.tp.slicing())}
            if self.merges:
                fill_merged_replica(self._replica, self.model, include_frozen=not self._replica_filled, **take)
            else:
                fill_replica(self._replica, self.model, bucket_bytes=self.cfg.sync_bucket_mib << 20, **take)
            if self.device.type == "cuda":  # the copies' (and a sharded model's gathers') device time
                torch.cuda.synchronize(self.device)
            self.replica_fill_s = time.perf_counter() - start
            self._replica_fresh = self._replica_filled = True
            self.replica_fills += 1
        return self._replica

    def _num_blocks(self, max_context: int, num_seqs: int) -> int:
        """Blocks for every sequence at its longest (no preemption) with headroom, so that the next call's slightly
        longer prompts still fit, or what the memory budget allows if fewer."""
        budget, needed = self._budget_blocks(), self._needed(max_context, num_seqs)
        self._capped = budget < needed
        return min(needed + needed // _HEADROOM, budget)

    def _needed(self, max_context: int, num_seqs: int) -> int:
        return 1 + max(num_seqs, 1) * -(-max(max_context, 1) // self.block_size)

    def _budget_blocks(self) -> int:
        per_block = ModelRunner.bytes_per_block(self.rank_config, self.block_size, self.dtype)
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
        blocks = int(budget // per_block)
        if self.tp is not None:  # the ranks of a group schedule alike: the same cache size on each
            blocks = int(all_reduce(blocks, "min", group=self.tp.group, device=self.device))
        return blocks

    def open_stream(self, sampling: SamplingParams, max_context: int, num_seqs: int) -> TokenStream:
        """A NativeStream; with tp_degree > 1 the group's first rank submits and the others mirror it (mirror.py)."""
        return open_mirrored(self.stream_group, self.open_local_stream, sampling, max_context, num_seqs)

    def open_local_stream(self, sampling: SamplingParams, max_context: int, num_seqs: int) -> NativeStream:
        """A stream over the paged cache: the module (a sharded model's replica, gathered now on every rank) and
        the cache sized for `num_seqs` sequences of `max_context` tokens (or what the budget allows)."""
        module = self._generating_module()  # before the cache is sized from the free memory
        runner = self._runner_for(module, max_context, num_seqs)
        runner.weights_changed()  # exact mode's cast copies of the current weights
        runner.images = NativeImages(module) if family_of(module.config).takes_images else None  # this stream's images
        return NativeStream(self, runner, sampling)

    def _runner_for(self, module: torch.nn.Module, max_context: int, num_seqs: int) -> ModelRunner:
        """The KV cache (and decode graphs) of the last call when they fit, else new ones; the block manager
        always starts empty (cached keys and values belong to the weights of their call)."""
        width = -(-max(max_context, 1) // self.block_size)
        cfg = self.cfg.native
        graphs = min(cfg.max_num_seqs, num_seqs) if cfg.cuda_graphs else 0  # only the batch sizes this call can use
        old = self._runner
        if (
            old is not None
            and old.model is module
            and old.max_blocks >= width
            and (old.max_batch >= graphs or not old.graphs)
            and (self._capped or old.blocks.num_blocks >= self._needed(max_context, num_seqs))
        ):
            old.blocks = BlockManager(old.blocks.num_blocks, self.block_size)
            old.restore()  # after a sleep: the cache's memory back at its addresses
            return old
        self._free_runner()  # free the old cache before measuring the memory for the new one
        blocks = BlockManager(self._num_blocks(max_context, num_seqs), self.block_size)
        self.cache_builds += 1
        width += 1 + width // _HEADROOM  # block-table room for longer prompts next time
        self._runner = ModelRunner(
            module, self.device, self.dtype, blocks, width, graphs, cfg.compile, cfg.paged_attention, self.releasable,
            tp_group=None if self.tp is None else self.tp.group, merged=cfg.merged_projections, exact=self.cfg.exact,
        )  # fmt: skip
        return self._runner


class NativeStream(TokenStream):
    """Sequences continuously batched through the paged cache: submitted ones join at the next prefill, finished
    ones leave at once (their full blocks stay cached for a later turn of the same sample)."""

    def __init__(self, engine: NativeRolloutEngine, runner: ModelRunner, sampling: SamplingParams):
        super().__init__(sampling, engine.device)
        self.engine, self.runner = engine, runner
        cfg = engine.cfg.native
        self.scheduler = Scheduler(runner.blocks, cfg.max_num_seqs, cfg.max_prefill_tokens)
        self.sampler = StepSampler(sampling, cfg.max_num_seqs, engine.device, engine.cfg.exact, runner.sampling)
        self.module = runner.model
        self.was_training = self.module.training
        self.module.eval()
        self.tags: dict[Sequence, object] = {}
        self.inflight: Launched | None = None
        self.num_ahead = 0
        self.num_constrained = 0
        """Submitted sequences with a grammar that have not finished."""
        self.stops = StopStrings(engine.tokenizer, sampling.stop) if sampling.stop else None
        self.stop_array = np.array(sorted(engine.stop_ids), dtype=np.int64)

    def submit(self, tag, request: TokenRequest) -> None:
        self.check(request)
        draws = request_uniforms([request], self.sampling.seed, self.sampling.max_new_tokens)
        own = request.sampling_of(self.sampling)  # a served client's own temperature / top_p / top_k, if any
        greedy = request.greedy or own.is_greedy
        special = bool(request.num_top_logprobs) or request.constraint is not None
        row = self.sampler.add_rows(draws, own, special=special)
        routes_prompt = request.num_prompt_routes if self.runner.routed_layers is not None else 0
        seq = Sequence(row, list(request.prompt_ids), request.max_new_tokens, greedy=greedy,
                       num_top_logprobs=request.num_top_logprobs, constraint=request.constraint,
                       num_prompt_routes=routes_prompt)  # fmt: skip
        if self.runner.images is not None:  # a vision-language model: mRoPE positions, the request's images
            self.runner.images.add(seq, request.prompt_ids, request.vision)
        elif request.vision is not None:
            raise UserError(f"request {request.key}: images for a text-only model")
        try:
            self.scheduler.add(seq)
        except ValueError as e:
            raise UserError(f"request {request.key}: {e}; raise rollout.kv_cache_gib") from None
        self.tags[seq] = tag
        self.num_constrained += request.constraint is not None

    @property
    def has_work(self) -> bool:
        return self.inflight is not None or not self.scheduler.done

    def step(self) -> list[tuple[object, Generated]]:
        """Launch the next model step (a decode step's successor is queued before its tokens are read where the
        scheduler can plan it from lengths alone), then finish the step launched before; the finished requests."""
        scheduler, inflight, launched = self.scheduler, self.inflight, None
        # a grammar's next mask needs the token before it: while a constrained sequence runs, steps are synchronous
        ahead_ok = self.engine.cfg.native.overlap and not self.num_constrained
        if inflight is not None and inflight.decode and ahead_ok:
            with record_function("rlx/schedule"):
                ahead = self._plan_ahead(inflight)
            if ahead is not None:
                self.num_ahead += 1
                cohort, rows = ahead
                launched = self._launch(cohort.seqs, True, (inflight.tokens, rows), cohort)
        elif inflight is None and not scheduler.done:
            with record_function("rlx/schedule"):
                step = scheduler.schedule()
            launched = self._launch(step.seqs, step.kind == "decode", None)
        finished = []
        if inflight is not None:
            with record_function("rlx/finish"):
                finished = self._finish(inflight)
            if launched is not None and launched.cohort is not None and launched.cohort.parent is inflight.cohort:
                launched.cohort.pull()  # its rows' lengths, now that the step before it was read back
        self.inflight = launched
        return [(self.tags.pop(s), _generated(s)) for s in finished]

    def _plan_ahead(self, inflight: Launched) -> tuple[Cohort, np.ndarray] | None:
        """The decode step run one token ahead of `inflight` (scheduler.schedule_ahead's plan, from the cohort's
        arrays): its cohort and the row of each of its sequences in `inflight`. None where the synchronous path
        must decide: a prefill is due, nothing is left, or a block is missing (preemption)."""
        if self.scheduler.prefill_due():
            return None
        cohort = inflight.cohort
        if cohort is None:  # a step of the synchronous path: its arrays, once
            cohort = inflight.cohort = Cohort(inflight.seqs, self.runner.blocks.block_size, self.runner.max_blocks)
        keep = cohort.continuing()
        if not keep.any():
            return None
        if keep.all():
            rows, ahead = np.arange(len(keep)), cohort
        else:
            rows = np.flatnonzero(keep)
            ahead = cohort.take(rows)
        return (ahead, rows) if ahead.reserve_next(self.runner.blocks) else None

    def _launch(self, seqs: list[Sequence], decode: bool, prev, cohort: Cohort | None = None) -> Launched:
        with record_function("rlx/decode" if decode else "rlx/prefill"):
            logits, routes = self.runner.forward(seqs, decode=decode, prev=prev, cohort=cohort)
        graph_size = self.runner.graph_size(len(seqs)) if decode else None
        with record_function("rlx/sample"):
            return self.sampler.launch(seqs, logits, decode, prev is not None, routes, cohort, graph_size)

    def _finish(self, step: Launched) -> list[Sequence]:
        """Append each sequence's sampled token; finish stopped sequences and return them."""
        cohort = step.cohort
        if cohort is not None and step.routes is None and step.top is None and self.stops is None:
            return self._finish_cohort(step, cohort)
        tokens, logprobs = self.sampler.collect(step)
        stop_ids, finished = self.engine.stop_ids, []
        if step.routes is not None and not step.decode:  # a prefill's rows past its sequences': prompt positions'
            at = len(step.seqs)
            for seq in step.seqs:
                pending = seq.pending_prompt_routes
                if pending:
                    seq.prompt_routes, at = step.routes[at : at + pending], at + pending
        read, done = np.zeros(len(step.seqs), bool), np.zeros(len(step.seqs), bool)
        for row, (seq, token, logprob) in enumerate(zip(step.seqs, tokens, logprobs)):
            if seq.status is not Status.RUNNING:
                continue  # it stopped at the step before: this token was computed ahead and is discarded
            read[row] = True
            seq.num_computed = len(seq)
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
            if step.routes is not None:  # the experts of the position that predicted this token
                seq.routed_experts.append(step.routes[row])
            if seq.num_top_logprobs:
                seq.top_logprobs.append(step.top[row])
            if seq.constraint is not None:
                seq.constraint.advance(token)
            stopped = token in stop_ids or (self.stops is not None and self.stops.hit(seq.output_ids))
            if stopped or len(seq.output_ids) >= seq.max_tokens:
                self.scheduler.finish(seq, "stop" if stopped else "length")
                finished.append(seq)
                done[row] = True
                self.num_constrained -= seq.constraint is not None
        if cohort is not None:
            cohort.advance(read, done)
        return finished

    def _finish_cohort(self, step: Launched, cohort: Cohort) -> list[Sequence]:
        """`_finish` for a plain step (no experts, top logprobs or stop strings to record) through its cohort."""
        tokens, logprobs = self.sampler.collect_arrays(step)
        finished = []
        for row, stopped in cohort.read_back(tokens, logprobs, self.stop_array):
            self.scheduler.finish(cohort.seqs[row], "stop" if stopped else "length")
            finished.append(cohort.seqs[row])
        return finished

    def stats(self) -> dict[str, int]:
        return {
            "preemptions": self.scheduler.preemptions,
            "steps_ahead": self.num_ahead,
            "prefill_tokens": self.scheduler.num_prefilled,
            "cached_prefix_tokens": self.runner.blocks.num_hit_tokens,
        }

    def progress(self) -> dict[object, int]:
        ahead = set(self.inflight.seqs) if self.inflight is not None else set()
        return {tag: len(seq.output_ids) + (seq in ahead) for seq, tag in self.tags.items()}

    def partial(self, tags: Collection[object]) -> dict[object, Generated]:
        return {tag: _sampled_so_far(seq) for seq, tag in self.tags.items() if seq.output_ids and tag in tags}

    def prompt_logprobs(self, request: TokenRequest, num_top: int) -> PromptLogprobs:
        """Through the Hugging Face layers of the module the stream decodes with (the model or its replica; the paged
        attention is the runner's within its own steps only)."""
        if self.engine.tp is not None:  # each rank holds a slice of every layer: one rank's forward is no model's
            raise UserError("the native engine scores prompts without tensor parallelism only (tp_degree 1)")
        engine = self.engine
        return teacher_forced(self.module, request, self.sampling, num_top, engine.device, engine.dtype)

    def weights_changed(self) -> None:
        """Refill the replica in place (the captured graphs read its storage) and stop reusing cached prefixes."""
        module = self.engine._generating_module()
        assert module is self.module, "the replica was rebuilt under an open stream"
        self.runner.weights_changed()
        self.runner.blocks.forget_cached()

    def close(self) -> None:
        """Wait for a step still in flight (its results are dropped) and restore the module's mode."""
        if self.inflight is not None:
            self.sampler.collect(self.inflight)
            self.inflight = None
        self.module.train(self.was_training)


def _tensor_parallel(model, cfg, ctx) -> TensorParallelGroup | None:
    """This rank's tensor-parallel group for rollout.tp_degree > 1 (None otherwise), after checking the model
    splits (a UserError naming what does not)."""
    if cfg.tp_degree == 1:
        return None
    if family_of(model.config).takes_images:
        raise UserError(f"tp_degree {cfg.tp_degree}: the native engine splits text models only")
    if is_lora_model(model) and cfg.native.lora_rollout != "merged":
        raise UserError(f"tp_degree {cfg.tp_degree}: a LoRA policy decodes split with lora_rollout = 'merged' only")
    check_splittable(model.config, cfg.tp_degree)
    return tensor_parallel_group(cfg.tp_degree, ctx)


def _generated(seq: Sequence) -> Generated:
    """A finished sequence's result (an MoE model's with its routing: [R, L, k] int16, and the prompt positions' it
    was asked for; the top logprobs a served request asked for)."""
    routes = torch.stack(seq.routed_experts) if seq.routed_experts else None
    top = seq.top_logprobs if seq.num_top_logprobs else None
    return Generated(seq.output_ids, seq.logprobs, seq.finish_reason, routed_experts=routes, top_logprobs=top,
                     prompt_routed_experts=seq.prompt_routes)  # fmt: skip


def _sampled_so_far(seq: Sequence) -> Generated:
    """An unfinished sequence's tokens so far with their logprobs (and alternatives, where asked): copies, as the
    sequence grows on."""
    top = list(seq.top_logprobs) if seq.num_top_logprobs else None
    return Generated(list(seq.output_ids), list(seq.logprobs), "", top_logprobs=top)


def _param_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point parameters."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
