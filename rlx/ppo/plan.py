"""The memory plan of `rlx ppo` on GPUs: per-rank peak memory of each phase (rollout, score, train) estimated from
the model's config.json, the number of GPUs, their memory and the recipe, and the settings the recipe leaves unset
chosen so the run fits (no torch import: a pure function of numbers, so `rlx ppo --plan` runs anywhere).

What a rank holds, as rlx holds it (rlx/training/trainer.py, rlx/parallel/fsdp.py, rlx/ppo/models.py,
rlx/rollout/native/engine.py):
- the trained model under FSDP2 mixed precision: float32 parameter shards (4 bytes per parameter / ranks), float32
  gradient shards (4 / ranks), AdamW's two float32 moments (8 / ranks); with train.param_offload all three stay on
  the CPU. Gradients of a mini-batch split into several micro-batches accumulate unsharded in float32 (FSDP2 with
  reduce_dtype float32 and gradient sync off until the last micro-batch): 4 bytes per parameter, not sharded; with
  train.grad_accumulation = "sharded" each micro-batch reduce-scatters into the shards instead (no whole copy);
- while a layer computes, its parameters gathered in bfloat16 (the next layer's prefetched), and the root's
  (embeddings, LM head) for the whole forward and backward;
- the reference policy (use_ref, no LoRA): a whole float32 copy on every rank (not sharded);
- the native engine's bfloat16 replica (a whole copy) and its KV cache, sized for this rank's share of the step's
  sequences at their longest plus 1/8; both released between rollouts with rollout.sleep;
- activations of a train micro-batch (a rank's rows split into the fewest micro-batches the token budget allows,
  of even size): per token and layer about 28*hidden + 8*kv_width + 9*intermediate bytes (the residual stream
  and norm inputs in float32, q/k/v, attention output, the gated MLP's intermediates: 4*intermediate when
  train.compile fuses the layers, since Inductor keeps only the two projections); with gradient checkpointing only
  the layer inputs (4.5*hidden bytes) stay, plus one layer recomputed at a time (`_activation_bytes_per_token`).
- a mixture of experts with train.ep_degree (rlx/parallel/experts.py): a rank gathers, and accumulates unsharded
  gradients for, 1 / ep_degree of each layer's experts; its sharded state is the same (FSDP shards the experts over
  the other ranks). When the recipe leaves ep_degree out, the plan tries each degree dividing the GPUs and the
  experts per layer, smallest first, before the next (costlier) rung of settings; CPU offload keeps ep_degree 1.
Around it: torch's allocator keeps some memory it cannot hand out (fragmentation) and the CUDA context and NCCL
buffers sit outside torch's count; both are taken off the device's memory before the estimates are compared.

Calibrated against a Qwen2.5-7B-shaped model on 4 x H100 80 GB (issue 34; 32 prompts x 8, 128 + 256 tokens, no
reference as in bench/grpo_step.py): the fast path's settings (engine resident, 6,144-token micro-batches, no
checkpointing) ran out of memory at 74.7 GiB allocated in the first train step (estimated: 121 GiB); with
rollout.sleep and gradient checkpointing it ran (estimated: 71 GiB of 72.9 usable). Checked against the measured peaks
of the Qwen2-0.5B shape (bench/scale.py, 1 and 2 x H100, fast path with compile): 45.6 and 38.1 GiB measured; the
estimates were 56.4 and 54.0 GiB before the compiled MLP term (8*intermediate), 42.2 and 39.7 with it (-7%, +4%).
The activation terms were refitted on one H200 (bench/plan_check.py, the trainer alone at 12k-98k tokens, eager,
compiled and checkpointed, 0.5B and 7B widths: bench/results/plan_check_h200.json): the old 20*hidden per layer
under-counted by 18-28% (the residual stream stays float32 under autocast), which the compile margin and the
runs' short prompts had hidden; the plan is now at or above each of those 14 peaks (+1% to +20% for the eager and
large ones; tests/unit/test_memory_plan.py).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any

from rlx.config import move_keys
from rlx.observe.flops import MOE_KEYS

GIB = float(2**30)
FRAGMENTATION = 0.06
"""Share of the device's memory torch's caching allocator holds but cannot hand out (measured 4-8% on long runs)."""
RESERVED_GIB = 1.5
"""CUDA context, cuBLAS workspaces and NCCL buffers: outside torch's allocated count."""
COMPILE_MARGIN = 0.04
"""At most this share of the device's memory is held for what a compiled run's peak adds beyond the counted parts
(torch.compile's fused kernels and workspaces, the engine's captured graphs beside the trainer): the plan turns
train.compile off when the run fits only without it."""
COMPILE_MARGIN_BYTES_PER_PARAM = 0.8
"""The margin grows with the model up to COMPILE_MARGIN of the device: `rlx ppo`'s train peaks on H200s
(bench/scale.py; tests/unit/test_memory_plan.py) went up to 3.0 GiB beyond the counted parts at 7B (full weights
on 4 GPUs; 2.1 with LoRA on one) and none at 0.5B, where a margin of 4% of the card (5.6 GiB) put the plan 23%
over the 4-GPU fixed work's 28.9 GiB peak. 0.8 bytes a parameter: 5.7 GiB at 7B (the cap on an H200), 0.4 at 0.5B."""
HEADROOM = 8
"""The native engine's KV cache gets 1/HEADROOM more blocks than a step needs (rlx/rollout/native/engine.py)."""
ASSUMED_PROMPT_TOKENS = 512
"""Prompt length assumed when the recipe sets no rollout.max_prompt_length."""
DECODE_STEP_OVERHEAD_MS = 1.7
"""The native engine's decode step time that is not reading the weights (sampling, attention over the cache,
launches), and what each doubling of rollout.tp_degree adds to it (two all-reduces a layer): fitted to the Qwen2-0.5B
and Qwen2.5-7B shapes on 4 x H100 (bench/tp_rollout.py, 256 sequences of 128 + 256 tokens: 0.5B 2.05 / 2.91 ms at tp
1 / 2, 7B 7.14 / 6.20 / 6.70 ms at tp 1 / 2 / 4)."""
DECODE_WEIGHT_BYTES_PER_MS = 2.79e9
"""Bytes of bfloat16 weights a decode step reads per millisecond on one GPU (the same fit: ~2.8 TB/s on an H100)."""
CHECKPOINT_BYTES_PER_PARAM = 12
"""A trained parameter in a checkpoint: its float32 weight and AdamW's two float32 moments."""
MIN_GOOD_BUDGET = 4096
"""Micro-batches smaller than this spend more time gathering FSDP shards than computing on a 7B-class model: the
plan prefers releasing the engine or checkpointing activations over going below it."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a decoder-only model's config.json."""

    layers: int
    hidden: int
    intermediate: int
    """Per token through the MLP (a mixture of experts: the experts it routes to, plus shared ones)."""
    kv_width: int
    """num_key_value_heads * head_dim."""
    vocab: int
    params: int
    """Every parameter (embeddings, an untied LM head, all experts, biases and norms)."""
    layer_params: int
    """One decoder layer's parameters (what FSDP gathers at a time)."""
    root_params: int
    """Embeddings, LM head and final norm (FSDP's root, gathered for a whole forward and backward)."""
    layer_expert_params: int = 0
    """One decoder layer's routed experts (a mixture of experts; 0 for a dense model): under expert parallelism a
    rank gathers 1 / ep_degree of them."""
    active_params: int = 0
    """The parameters one token passes through (all of them for a dense model; 0 = params)."""
    num_experts: int = 0
    """Routed experts per layer (0 for a dense model)."""
    experts_per_token: int = 0
    """Routed experts a token goes to (top-k)."""
    heads: int = 0
    kv_heads: int = 0
    """Attention and key/value heads (a tensor-parallel engine splits both)."""

    @property
    def expert_params(self) -> int:
        """Every layer's routed experts."""
        return self.layers * self.layer_expert_params

    def local_params(self, ep_degree: int) -> int:
        """The parameters a rank holds whole under expert parallelism: the experts divided by ep_degree."""
        return self.params - self.expert_params + self.expert_params // ep_degree

    def local_layer_params(self, ep_degree: int) -> int:
        """One decoder layer's parameters as a rank gathers them (its share of the experts)."""
        return self.layer_params - self.layer_expert_params + self.layer_expert_params // ep_degree

    @property
    def input_embedding_params(self) -> int:
        """An untied model's input embeddings (0 when the LM head shares them): no autocast copy of them is made
        (an embedding lookup runs in the weights' dtype)."""
        return max(self.root_params - self.hidden - self.vocab * self.hidden, 0)

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token, all layers, bfloat16."""
        return 2 * self.layers * self.kv_width * 2


def _get(config: dict, key: str, default: Any = None) -> Any:
    value = config.get(key, default)
    return default if value is None else value


def model_shape(config: dict) -> ModelShape:
    """The shape of a config.json (a vision-language model's text config); KeyError/ValueError when it lacks one."""
    text = config.get("text_config") or config
    hidden, layers, vocab = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])
    heads = int(text["num_attention_heads"])
    head_dim = int(_get(text, "head_dim", hidden // heads))
    kv_width = int(_get(text, "num_key_value_heads", heads)) * head_dim
    has_bias = text.get("model_type", config.get("model_type", "")).startswith("qwen2") or bool(
        text.get("attention_bias")
    )
    attention = hidden * heads * head_dim * 2 + 2 * hidden * kv_width
    attention += (heads * head_dim + 2 * kv_width) if has_bias else 0
    mlp_total, mlp_active, experts, routed = _mlp_params(text, hidden)
    layer_params = attention + mlp_total + 2 * hidden
    tied = bool(_get(text, "tie_word_embeddings", config.get("tie_word_embeddings", False)))
    root = vocab * hidden * (1 if tied else 2) + hidden
    active_intermediate = mlp_active // (3 * hidden)
    params = layers * layer_params + root
    active = params - layers * (mlp_total - mlp_active - hidden * experts)  # every token runs the router
    kv_heads = int(_get(text, "num_key_value_heads", heads))
    top_k = int(_get(text, "num_experts_per_tok", 2)) if experts else 0
    return ModelShape(layers, hidden, active_intermediate, kv_width, vocab, params, layer_params, root,
                      layer_expert_params=routed, active_params=active, num_experts=experts, heads=heads,
                      experts_per_token=top_k, kv_heads=kv_heads)  # fmt: skip


def _mlp_params(text: dict, hidden: int) -> tuple[int, int, int, int]:
    """(parameters of one layer's MLP, those of its experts a token passes through, routed experts, the routed
    experts' parameters): dense, or experts + router (+ shared)."""
    experts = next((int(text[k]) for k in MOE_KEYS if _get(text, k, 0)), 0)
    dense = int(_get(text, "intermediate_size", 4 * hidden))
    if not experts:
        return 3 * hidden * dense, 3 * hidden * dense, 0, 0
    width = int(_get(text, "moe_intermediate_size", dense))
    per_token = int(_get(text, "num_experts_per_tok", 2))
    shared = int(_get(text, "shared_expert_intermediate_size", 0))
    routed = experts * 3 * hidden * width
    total = routed + hidden * experts + 3 * hidden * shared
    return total, per_token * 3 * hidden * width + 3 * hidden * shared, experts, routed


@dataclass(frozen=True)
class Workload:
    """What the recipe asks of each step (a recipe tree after --set, with the fast path's keys filled in)."""

    sequences: int
    """Samples per step: prompts_per_step * rollout.sampling.n."""
    prompt_tokens: int
    response_tokens: int
    optimizer_steps: int
    """Optimizer steps per epoch (the batch split by train.mini_batch_size)."""
    engine: str
    use_ref: bool
    has_critic: bool
    has_lora: bool
    max_prefill_tokens: int
    vllm_memory_fraction: float
    prompt_known: bool = True
    """Whether rollout.max_prompt_length bounds every context (else ASSUMED_PROMPT_TOKENS is a guess, and the KV
    cache is left to the engine's own sizing)."""
    launched: bool = False
    """Run under a launcher (torchrun): FSDP shards the models even on one process, so CPU offload is possible."""
    critic_own_model: bool = False
    """The critic starts from its own folder (critic.path) or trains adapters, not from a copy of the policy."""

    @property
    def sample_tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens

    @classmethod
    def from_recipe(cls, tree: dict) -> Workload:
        """The workload of a recipe tree (its old flat keys read at their new places, MOVED_KEYS)."""
        from rlx.ppo.config import MOVED_KEYS

        tree = copy.deepcopy(tree)
        move_keys(tree, MOVED_KEYS)

        def table(name: str) -> dict:
            return tree.get(name) if isinstance(tree.get(name), dict) else {}

        rollout, train, data = table("rollout"), table("train"), table("data")
        sampling, native, agent = (rollout.get(k) if isinstance(rollout.get(k), dict) else {} for k in _ROLLOUT_TABLES)
        sequences = int(data.get("prompts_per_step", 8)) * int(sampling.get("n", 1))
        mini = int(train.get("mini_batch_size", 0))
        return cls(
            sequences=sequences,
            prompt_tokens=int(rollout.get("max_prompt_length") or ASSUMED_PROMPT_TOKENS),
            response_tokens=int(sampling.get("max_new_tokens", 256)),
            optimizer_steps=max(1, math.ceil(sequences / mini)) if mini else 1,
            engine=str(rollout.get("engine", "hf")),
            use_ref=bool(tree.get("use_ref", True)) and "lora" not in tree,
            has_critic="critic" in tree,
            has_lora="lora" in tree,
            max_prefill_tokens=int(native.get("max_prefill_tokens", 16384)),
            vllm_memory_fraction=float(rollout.get("gpu_memory_utilization", 0.5)),
            # an episode's context (earlier turns, tool output) can outgrow prompt + response: not bounded then
            prompt_known=bool(rollout.get("max_prompt_length")) and not (agent.get("env") or agent.get("agent")),
            critic_own_model=bool(table("critic").get("path")) or "lora" in table("critic"),
        )


_ROLLOUT_TABLES = ("sampling", "native", "agent")  # a recipe tree's [rollout.*] tables the plan reads (old keys moved)


@dataclass(frozen=True)
class Settings:
    """The memory-relevant settings of a run (what the plan chooses among)."""

    sleep: bool = False
    gradient_checkpointing: bool = False
    train_tokens: int = 32768
    """train.max_tokens_per_micro_batch."""
    score_tokens: int = 32768
    compile: bool = False
    param_offload: bool = False
    kv_cache_gib: float = 0.0
    """The native engine's KV cache; 0: what a step needs plus 1/8."""
    grad_accumulation: str = "unsharded"
    """train.grad_accumulation: 'sharded' reduces every micro-batch's gradient into the shards (no whole float32
    gradient per rank)."""
    tp_degree: int = 1
    """rollout.tp_degree: the native engine's replica split over this many GPUs (its KV cache per rank is the same:
    the group's sequences, a 1 / tp_degree share of the heads)."""
    ep_degree: int = 1
    """train.ep_degree: a mixture of experts' experts split over this many ranks (gathered and accumulated
    gradients hold 1 / ep_degree of them)."""
    keep_gathered: bool = False
    """train.keep_gathered: FSDP keeps the whole model gathered in bfloat16 over a phase's micro-batches (one
    all-gather per layer and phase)."""


@dataclass
class Estimate:
    """Per-rank peak GiB of each phase, and the parts of the largest one."""

    phases: dict[str, float]
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def peak(self) -> float:
        return max(self.phases.values())


def usable_gib(gpu_memory_gib: float) -> float:
    """What torch can allocate of a device with this much memory (fragmentation, context and NCCL taken off)."""
    return gpu_memory_gib * (1 - FRAGMENTATION) - RESERVED_GIB


def kv_cache_need_gib(shape: ModelShape, work: Workload, world: int) -> float:
    """The native engine's KV cache for this rank's share of the step's sequences at their longest, plus 1/8."""
    per_rank = math.ceil(work.sequences / world)
    return per_rank * work.sample_tokens * shape.kv_bytes_per_token * (1 + 1 / HEADROOM) / GIB


def _engine_gib(shape: ModelShape, work: Workload, settings: Settings, world: int, gpu_gib: float) -> float:
    """What the rollout engine holds while it generates: its replica and KV cache."""
    if work.engine == "vllm":
        return work.vllm_memory_fraction * gpu_gib
    kv = settings.kv_cache_gib or kv_cache_need_gib(shape, work, world)
    if work.engine == "hf":  # generates with the trained module: no replica, a dynamic cache
        return kv
    return shape.params * 2 / settings.tp_degree / GIB + kv


def _trained_gib(shape: ModelShape, work: Workload, settings: Settings, world: int, phase: str) -> float:
    """The trained models' parameters, gradients and AdamW state on this rank (actor, and a critic like it)."""
    if work.has_lora:  # the frozen base in bfloat16, sharded; adapters are small
        per_param = 2.0 / world
    elif settings.param_offload:
        per_param = 0.0
    else:
        per_param = (4 + 8 + (4 if phase == "train" else 0)) / world
    models = 2 if work.has_critic else 1
    return models * shape.params * per_param / GIB


def _activation_bytes_per_token(shape: ModelShape, checkpointing: bool, compiled: bool = False) -> float:
    """Bytes a train micro-batch keeps per token for the backward. Per layer 28*hidden (the residual stream and
    the norms' inputs in float32, q/k/v and attention's output and statistics) + 8*kv_width + 9*intermediate (the
    gated MLP's gate, up, activation and product); compiled layers keep 4*intermediate (Inductor keeps only the two
    projections). With gradient checkpointing each layer keeps its input (float32: 4.5*hidden with the rotary
    tables) and one layer at a time is recomputed. Fitted on one H200 by bench/plan_check.py (0.5B shape at 24 and
    12 layers, 12k-98k tokens; 7B shape at 4 layers): within 6% of every measured slope."""
    per_layer = 28 * shape.hidden + 8 * shape.kv_width + (4 if compiled else 9) * shape.intermediate
    # a mixture of experts keeps each token's hidden state once per routed expert: gathered in, out, weighted
    per_layer += 6 * shape.experts_per_token * shape.hidden
    head = 16 * shape.hidden  # final norm, hidden-state gradients around the fused logprobs
    if checkpointing:
        return shape.layers * 9 * shape.hidden / 2 + per_layer + head
    return shape.layers * per_layer + head


def _train_gib(shape: ModelShape, work: Workload, settings: Settings, world: int) -> dict[str, float]:
    """The train phase's transient parts: activations, gathered layers and root, accumulated gradients."""
    tokens_per_rank = math.ceil(work.sequences / work.optimizer_steps / world) * work.sample_tokens
    micro_batches = math.ceil(tokens_per_rank / settings.train_tokens)
    ep = settings.ep_degree  # the actor's experts; a critic (its own module) is not expert-parallel
    whole = shape.local_params(ep) + (shape.params if work.has_critic else 0)
    unsharded = settings.grad_accumulation == "unsharded"
    # unsharded accumulation: FSDP2 keeps each parameter's whole gradient in the compute dtype (bfloat16) across
    # the micro-batches until the last one reduces it (7B on 2 x H200: 14.1 GiB over sharded accumulation)
    accumulated = whole * 2 if micro_batches > 1 and world > 1 and unsharded and not work.has_lora else 0
    # FSDP: two layers gathered in bf16 and their fp32 gradients, the root for the whole pass (with keep_gathered
    # every layer in bf16, one layer's fp32 gradient); one process: autocast keeps a bfloat16 copy of every float32
    # weight but the input embeddings (none of a LoRA policy's base, already bfloat16: 65.6 GiB measured at 7B on one
    # H200, 78.7 planned with it)
    if world == 1 and not settings.param_offload:  # offload: FSDP over the one rank (under torchrun)
        gathered = 0 if work.has_lora else (shape.params - shape.input_embedding_params) * 2
    elif settings.keep_gathered:
        gathered = shape.local_params(ep) * 2 + shape.local_layer_params(ep) * 8 + shape.root_params * 4
    else:
        gathered = shape.local_layer_params(ep) * 12 + shape.root_params * 6
    tokens = math.ceil(tokens_per_rank / micro_batches)  # the trainer splits a rank's rows into even parts
    activations = tokens * _activation_bytes_per_token(shape, settings.gradient_checkpointing, settings.compile)
    return {
        "activations": activations / GIB,
        "gathered": gathered / GIB,
        "accumulated_grads": accumulated / GIB,
    }


def estimate(shape: ModelShape, work: Workload, settings: Settings, world: int, gpu_gib: float) -> Estimate:
    """Per-rank peak GiB of the rollout, score and train phases of a step with these settings."""
    ref = shape.params * 4 / GIB if work.use_ref else 0.0
    engine = _engine_gib(shape, work, settings, world, gpu_gib)
    resident_engine = 0.0 if settings.sleep else engine
    prefill = work.max_prefill_tokens * (12 * shape.hidden + 6 * shape.intermediate) / GIB
    rollout = _trained_gib(shape, work, settings, world, "rollout") + ref + engine + prefill
    score_tokens = settings.score_tokens
    forward = score_tokens * (16 * shape.hidden + 8 * shape.intermediate) / GIB
    ep = settings.ep_degree
    if world == 1 and not settings.param_offload:
        gathered = 0.0
    elif settings.keep_gathered:
        gathered = shape.local_params(ep) * 2 / GIB
    else:
        gathered = (shape.local_layer_params(ep) * 4 + shape.root_params * 2) / GIB
    score = _trained_gib(shape, work, settings, world, "score") + ref + resident_engine + forward + gathered
    train_parts = {
        "trained_state": _trained_gib(shape, work, settings, world, "train"),
        "reference": ref,
        "engine": resident_engine,
        **_train_gib(shape, work, settings, world),
    }
    train = sum(train_parts.values())
    if settings.compile:
        margin = compile_margin_gib(shape, gpu_gib)
        train += margin
        train_parts["compile"] = margin
    return Estimate({"rollout": rollout, "score": score, "train": train}, train_parts)


def compile_margin_gib(shape: ModelShape, gpu_gib: float) -> float:
    """GiB the plan holds beside a compiled train phase's counted parts (COMPILE_MARGIN_BYTES_PER_PARAM)."""
    return min(COMPILE_MARGIN * gpu_gib, COMPILE_MARGIN_BYTES_PER_PARAM * shape.params / GIB)


HOST_RESERVED_SHARE = 0.1
"""Share of a host's memory the plan leaves to the kernel, the page cache (data, checkpoint files) and other work."""
HOST_GIB_PER_RANK = 4.0
"""A rank's own host memory beside the model's: Python, torch and the CUDA libraries, the CUDA context's host side,
torch.compile's workers."""


@dataclass(frozen=True)
class Host:
    """The memory of one host (machine) and how many of the run's ranks it holds."""

    memory_gib: float
    ranks: int

    @property
    def usable_gib(self) -> float:
        return self.memory_gib * (1 - HOST_RESERVED_SHARE)


def host_gib(shape: ModelShape, work: Workload, settings: Settings, world: int, ranks: int) -> dict[str, float]:
    """Peak GiB of one host holding `ranks` of the `world` ranks, at the start and in steady steps:
    - 'load': the whole float32 policy on the host, with its reference and a new critic copied from it, before the
      trainer shards them onto its GPU (rlx/ppo/models.py): on rank 0 alone under a launcher (the host holding it),
      on every rank with LoRA, a critic of its own folder or adapters, or experts split over ranks;
    - 'steady': the checkpoints' host buffers, pinned for the run (float32 weights and AdamW's two moments, 12 bytes
      per parameter, a 1 / world share on each rank, in whole pinned chunks: `_pinned_gib`; a LoRA policy's adapters
      are small),
      and with train.param_offload the float32 parameter, gradient and optimizer shards and the temporary AdamW's
      step on the CPU makes of the second moment's square root (20 bytes / world: the 0.5B offloaded run on one H200
      held 18.9 GiB, 17.0 planned without that term)."""
    # a fresh start under a launcher: rank 0 alone loads the policy, the others take their shards from it
    # (rlx/ppo/models.py `_filled_from_rank0`); with a critic, LoRA or split experts every rank loads it
    loading = 1 if _rank0_loads(work, settings, world) else ranks
    load = loading * _loaded_gib(shape, work) + ranks * HOST_GIB_PER_RANK
    models = 2 if work.has_critic else 1
    pinned = 0.0 if work.has_lora else _pinned_gib(shape, 4, world) + _pinned_gib(shape, 8, world)
    offloaded = shape.params * 20.0 / world / GIB if settings.param_offload else 0.0
    steady = ranks * (models * (pinned + offloaded) + HOST_GIB_PER_RANK)
    return {"load": load, "steady": steady}


def _pinned_gib(shape: ModelShape, bytes_per_param: int, world: int) -> float:
    """The pinned host buffers of one checkpoint tag of a rank (its float32 weights: 4 bytes a parameter; AdamW's
    moments: 8), in whole chunks: rlx/utils/host_copy.py carves them out of chunks of one power-of-two size, at least
    the largest tensor's shard (the embedding's rows over the ranks; FSDP shards dimension 0). Without the rounding
    the plan was 5 GiB under rank 0's host memory at 7B on one H200 (94.0 GiB measured; 2.0 on two, 0.6 on four)."""
    from rlx.utils.host_copy import pinned_chunk_bytes

    chunk = pinned_chunk_bytes(math.ceil(max(shape.vocab, shape.intermediate) / world) * shape.hidden * 4)
    return math.ceil(shape.params * bytes_per_param / world / chunk) * chunk / GIB


def _rank0_loads(work: Workload, settings: Settings, world: int) -> bool:
    """Whether a fresh start's rank 0 alone loads the policy (and the reference and critic copied from it) on its
    host (rlx/ppo/models.py `_filled_from_rank0`)."""
    return world > 1 and not work.has_lora and not work.critic_own_model and settings.ep_degree == 1


def _loaded_gib(shape: ModelShape, work: Workload) -> float:
    """What one rank builds on the host before sharding: the float32 policy, its reference and a critic copied."""
    return shape.params * 4 * (1 + int(work.use_ref) + int(work.has_critic)) / GIB


# --- choosing the settings ------------------------------------------------------------------------------------

_CHOICES = {  # dotted recipe key -> Settings field
    "rollout.sleep": "sleep",
    "train.gradient_checkpointing": "gradient_checkpointing",
    "train.max_tokens_per_micro_batch": "train_tokens",
    "score.max_tokens_per_micro_batch": "score_tokens",
    "train.compile": "compile",
    "train.param_offload": "param_offload",
    "train.grad_accumulation": "grad_accumulation",
    "rollout.kv_cache_gib": "kv_cache_gib",
    "train.ep_degree": "ep_degree",
    "rollout.tp_degree": "tp_degree",
    "train.keep_gathered": "keep_gathered",
}
_LADDER = [  # in order of cost: the first that fits wins
    {"keep_gathered": True},  # several ranks: the fewest collectives
    {},
    {"sleep": True},
    {"sleep": True, "grad_accumulation": "sharded"},
    {"sleep": True, "gradient_checkpointing": True},
    {"sleep": True, "gradient_checkpointing": True, "grad_accumulation": "sharded"},
    {"sleep": True, "gradient_checkpointing": True, "grad_accumulation": "sharded", "compile": False},
    {"sleep": True, "gradient_checkpointing": True, "compile": False, "param_offload": True},
]


@dataclass
class MemoryPlan:
    """The plan for one hardware: whether the run fits, the settings chosen for unset keys, the estimate."""

    world: int
    gpu_memory_gib: float
    fits: bool
    chosen: dict[str, Any]
    """{dotted recipe key: value} for keys the recipe leaves unset."""
    estimate: Estimate
    settings: Settings
    message: str = ""
    """Why nothing fits and what would (empty when it fits)."""
    shape: ModelShape | None = None
    """The model's sizes (a mixture of experts' line in the summary: total, active, in experts)."""
    decode_ms: dict[int, float] = field(default_factory=dict)
    """{rollout.tp_degree: predicted decode step ms} of the degrees the plan chose among (empty: no choice)."""
    host: Host | None = None
    """The host's memory the plan checked the run against (None: not checked)."""
    host_gib: dict[str, float] = field(default_factory=dict)
    """host_gib() of the chosen settings (empty when the host was not checked)."""
    checkpoint_bytes: int = 0
    """One checkpoint's size (planned_checkpoint_bytes(); 0: not known)."""
    kv_note: str = ""
    """A line on a KV cache smaller than the step's need, where only that fits (empty otherwise)."""

    def summary(self) -> str:
        """One compact block: the hardware, the chosen settings, the per-phase peaks against the usable memory."""
        phases = ", ".join(f"{name} {gib:.1f}" for name, gib in self.estimate.phases.items())
        parts = ", ".join(f"{name} {gib:.1f}" for name, gib in self.estimate.parts.items() if gib >= 0.05)
        settings = ", ".join(f"{k}={_literal(v)}" for k, v in self.chosen.items()) or "(nothing to change)"
        head = f"rlx ppo: memory plan for {self.world} x {self.gpu_memory_gib:.0f} GiB"
        verdict = "fits" if self.fits else "DOES NOT FIT"
        return (
            f"{head}: {verdict}; peak GiB per rank {phases} of {usable_gib(self.gpu_memory_gib):.1f} usable\n"
            + self._moe_line()
            + self._decode_line()
            + self.kv_note
            + self._host_line()
            + self._checkpoint_line()
            + f"  train peak: {parts}\n"
            f"  chosen (keys the recipe leaves out): {settings}" + (f"\n  {self.message}" if self.message else "")
        )

    def _decode_line(self) -> str:
        """The rollout's tensor-parallel degree against the others it could have (empty when there was no choice)."""
        if len(self.decode_ms) < 2:
            return ""
        options = ", ".join(f"tp {d} {ms:.1f}" for d, ms in sorted(self.decode_ms.items()))
        return f"  rollout: tp_degree {self.settings.tp_degree} (predicted decode step ms: {options})\n"

    def _host_line(self) -> str:
        """The host's peak against its usable memory (empty when the host was not checked)."""
        if self.host is None or not self.host_gib:
            return ""
        peaks = ", ".join(f"{name} {gib:.0f}" for name, gib in self.host_gib.items())
        usable = f"{self.host.usable_gib:.0f} usable of {self.host.memory_gib:.0f}"
        return f"  host: peak GiB {peaks} of {usable} ({self.host.ranks} ranks per host)\n"

    def _checkpoint_line(self) -> str:
        """What one checkpoint writes (the run folder needs room for it; `rlx ppo` checks before step 1)."""
        if not self.checkpoint_bytes:
            return ""
        return (
            f"  checkpoint: about {self.checkpoint_bytes / 1e9:.1f} GB each (float32 weights and AdamW's two moments)\n"
        )

    def _moe_line(self) -> str:
        """A mixture of experts' sizes and expert parallelism (empty for a dense model)."""
        shape = self.shape
        if shape is None or not shape.num_experts:
            return ""
        billions = f"{shape.params / 1e9:.2f}B parameters, {shape.active_params / 1e9:.2f}B active per token"
        experts = f"{shape.expert_params / 1e9:.2f}B in {shape.num_experts} experts per layer"
        ep = self.settings.ep_degree
        return f"  MoE: {billions}, {experts}; ep_degree {ep}: a rank gathers 1/{ep} of each layer's experts\n"


def _literal(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _budgets(default: int, floor: int, tokens_per_rank: int) -> list[int]:
    """Micro-batch token budgets to try, largest first: one micro-batch per rank (no gradient accumulation) when it
    is above the default, then the default down to `floor` in steps of 1024."""
    step = 1024
    top = math.ceil(tokens_per_rank / step) * step
    down = list(range(default // step * step, floor - 1, -step)) or [floor]
    return ([top] if top > default else []) + down


def _fixed(user: dict[str, Any], settings: Settings) -> Settings:
    """`settings` with the recipe's own values of the chosen keys put back."""
    values = {_CHOICES[key]: user[key] for key in _CHOICES if key in user}
    return replace(settings, **values)


def plan_memory(
    config: dict, tree: dict, user: dict[str, Any], world: int, gpu_memory_gib: float, host: Host | None = None,
    launched: bool = False,
) -> MemoryPlan:  # fmt: skip
    """The plan for `world` GPUs of `gpu_memory_gib` each, on hosts of `host` (None: the GPUs only). `tree`: the
    recipe after --set with the fast path's keys filled in; `user`: {dotted key: value} of the keys the recipe (or
    --set) itself gives, which the plan keeps. `launched`: one process under torchrun (several always are; a recipe
    that sets train.param_offload is taken to be launched: a plain process then stops saying it needs torchrun)."""
    launched = launched or world > 1 or "train.param_offload" in user
    shape, work = model_shape(config), replace(Workload.from_recipe(tree), launched=launched)
    base = _fixed(user, _settings_of(tree))
    plan = _search(shape, work, base, user, world, gpu_memory_gib, host)
    if plan.fits:
        return plan
    if (smaller := _smaller_cache(shape, work, base, user, world, gpu_memory_gib, host)) is not None:
        return smaller
    if host is not None and (gpus_only := _search(shape, work, base, user, world, gpu_memory_gib)).fits:
        # the host is what does not hold it: the GPUs' plan, with the host's peaks and what host would hold it
        gpus_only.fits, gpus_only.host = False, host
        gpus_only.host_gib = host_gib(shape, work, gpus_only.settings, world, host.ranks)
        gpus_only.message = _host_message(shape, work, gpus_only.settings, world, gpu_memory_gib, host)
        return gpus_only
    plan.message = _what_fits(shape, work, base, user, world, gpu_memory_gib, host)
    return plan


def _smaller_cache(shape: ModelShape, work: Workload, base: Settings, user: dict, world: int, gpu_gib: float,
                   host: Host | None) -> MemoryPlan | None:  # fmt: skip
    """The plan with the native engine's KV cache at 1/2, 1/4, ... 1/16 of the step's need (not below one sequence
    at its longest) where the whole cache does not fit but a smaller one does: the cache is a pool, so fewer of the
    step's sequences decode at once (the rest wait, or are preempted and recomputed) and the rollout is slower."""
    if work.engine != "native" or not work.prompt_known or "rollout.kv_cache_gib" in user:
        return None
    need = kv_cache_need_gib(shape, work, world)
    one = work.sample_tokens * shape.kv_bytes_per_token / GIB
    for share in (2, 4, 8, 16):
        kv = math.ceil(need / share * 4) / 4
        if kv < one:
            return None
        plan = _search(shape, work, replace(base, kv_cache_gib=kv), user, world, gpu_gib, host)
        if plan.fits:
            plan.kv_note = (
                f"  rollout: kv_cache_gib {kv:g} holds about 1/{share} of the step's sequences at their longest "
                f"(all of them: {need:.1f} GiB, which does not fit): more of them wait to decode, a slower rollout\n"
            )
            return plan
    return None


def _settings_of(tree: dict) -> Settings:
    tables = ("rollout", "train", "score")
    rollout, train, score = (tree.get(k) if isinstance(tree.get(k), dict) else {} for k in tables)
    return Settings(
        sleep=bool(rollout.get("sleep") or rollout.get("engine") == "vllm" and rollout.get("sleep") is None),
        gradient_checkpointing=bool(train.get("gradient_checkpointing", False)),
        train_tokens=int(train.get("max_tokens_per_micro_batch") or 32768),
        score_tokens=int(score.get("max_tokens_per_micro_batch") or 16384),
        compile=bool(train.get("compile", False)),
        param_offload=bool(train.get("param_offload", False)),
        grad_accumulation=str(train.get("grad_accumulation", "unsharded")),
        kv_cache_gib=float(rollout.get("kv_cache_gib", 0.0)),
        ep_degree=int(train.get("ep_degree", 1)),
        tp_degree=int(rollout.get("tp_degree", 1)),
        keep_gathered=bool(train.get("keep_gathered", False)),
    )


def _search(shape: ModelShape, work: Workload, base: Settings, user: dict, world: int, gpu_gib: float,
            host: Host | None = None) -> MemoryPlan:  # fmt: skip
    """The first rung of the ladder (then the largest micro-batch) that fits the GPUs and the host, with the recipe's
    own keys kept; the last rung's estimate when none does."""
    usable = usable_gib(gpu_gib)
    tokens_per_rank = math.ceil(work.sequences / work.optimizer_steps / world) * work.sample_tokens
    floor = math.ceil(work.sample_tokens / 1024) * 1024
    last = None
    for minimum in (min(MIN_GOOD_BUDGET, base.train_tokens), floor):
        tps = _tp_degrees(shape, work, world, base, user)
        for rung, ep, tp in ((r, e, t) for r in _LADDER for e in _ep_degrees(shape, world, base, user) for t in tps):
            settings = _fixed(user, replace(base, **rung, ep_degree=ep, tp_degree=tp))
            # FSDP's CPU offload needs a launcher, and does not combine with expert parallelism
            if settings.param_offload and (not work.launched or settings.ep_degree > 1):
                continue
            if settings.keep_gathered and (world == 1 or settings.param_offload) and "train.keep_gathered" not in user:
                continue  # nothing is sharded on one process; offloaded shards are gathered from the CPU
            budgets = [settings.train_tokens] if "train.max_tokens_per_micro_batch" in user else None
            for tokens in budgets or _budgets(base.train_tokens, max(minimum, floor), tokens_per_rank):
                trial = _fit_score(shape, work, replace(settings, train_tokens=tokens), user, world, gpu_gib, floor)
                last = estimate(shape, work, trial, world, gpu_gib)
                if last.peak <= usable and _host_fits(shape, work, trial, world, host):
                    return _plan(world, gpu_gib, True, trial, last, base, user, shape, work, host)
    return _plan(world, gpu_gib, False, trial, last, base, user, shape, work, host)


def _host_fits(shape: ModelShape, work: Workload, settings: Settings, world: int, host: Host | None) -> bool:
    if host is None:
        return True
    return max(host_gib(shape, work, settings, world, host.ranks).values()) <= host.usable_gib


def _ep_degrees(shape: ModelShape, world: int, base: Settings, user: dict) -> list[int]:
    """The train.ep_degree values to try, smallest first: the recipe's own (or 1 for a dense model), else every
    divisor of the number of GPUs that divides the experts per layer."""
    if "train.ep_degree" in user or not shape.num_experts:
        return [base.ep_degree]
    return [d for d in range(1, world + 1) if world % d == 0 and shape.num_experts % d == 0]


def _tp_degrees(shape: ModelShape, work: Workload, world: int, base: Settings, user: dict) -> list[int]:
    """The rollout.tp_degree values to try, fastest decode first (`decode_step_ms`): the recipe's own (or 1 for
    another engine than the native one, or multi-turn rollouts), else every divisor of the number of GPUs that
    divides the heads and the key/value heads."""
    if "rollout.tp_degree" in user or work.engine != "native" or not work.prompt_known or not shape.kv_heads:
        return [base.tp_degree]
    degrees = [d for d in range(1, world + 1) if world % d == 0 and shape.heads % d == 0 and shape.kv_heads % d == 0]
    return sorted(degrees, key=lambda d: (decode_step_ms(shape, d), d))


def decode_step_ms(shape: ModelShape, tp_degree: int) -> float:
    """The native engine's predicted decode step at this tensor-parallel degree: the per-step overhead (growing with
    each doubling of the degree) plus reading a 1 / tp_degree share of the bfloat16 weights. Whatever the degree, a
    GPU decodes the same share of the step's sequences and reads the same share of their cache (a replica of
    tp_degree GPUs takes tp_degree times the sequences of one), so only these two terms differ."""
    overhead = DECODE_STEP_OVERHEAD_MS * (1 + math.log2(tp_degree))
    return overhead + shape.params * 2 / tp_degree / DECODE_WEIGHT_BYTES_PER_MS


def _fit_score(shape: ModelShape, work: Workload, settings: Settings, user: dict, world: int, gpu_gib: float,
               floor: int) -> Settings:  # fmt: skip
    """`settings` with the score micro-batch budget halved (not below one sample) while the score phase alone is
    over the usable memory, unless the recipe sets it."""
    if "score.max_tokens_per_micro_batch" in user:
        return settings
    usable = usable_gib(gpu_gib)
    while settings.score_tokens > floor and estimate(shape, work, settings, world, gpu_gib).phases["score"] > usable:
        settings = replace(settings, score_tokens=max(floor, settings.score_tokens // 2 // 1024 * 1024))
    return settings


def _plan(world, gpu_gib, fits, settings, est, base, user, shape, work, host=None) -> MemoryPlan:  # noqa: ANN001
    """The MemoryPlan, the native engine's KV cache sized to what a step needs (when the recipe leaves it unset)."""
    if work.engine == "native" and work.prompt_known and "rollout.kv_cache_gib" not in user and not base.kv_cache_gib:
        settings = replace(settings, kv_cache_gib=math.ceil(kv_cache_need_gib(shape, work, world) * 4) / 4)
    chosen = {}
    for key, name in _CHOICES.items():
        value = getattr(settings, name)
        if key not in user and (value != getattr(base, name) or key == "rollout.kv_cache_gib" and value):
            chosen[key] = value
    if "rollout.sleep" not in user and "rollout.sleep" not in chosen and work.engine == "native":
        chosen["rollout.sleep"] = settings.sleep
    options = _tp_degrees(shape, work, world, base, user)
    decode = {d: decode_step_ms(shape, d) for d in options} if len(options) > 1 else {}
    on_host = host_gib(shape, work, settings, world, host.ranks) if host is not None else {}
    return MemoryPlan(world, gpu_gib, fits, chosen, est, settings, shape=shape, decode_ms=decode, host=host,
                      host_gib=on_host, checkpoint_bytes=planned_checkpoint_bytes(shape, work))  # fmt: skip


def planned_checkpoint_bytes(shape: ModelShape, work: Workload) -> int:
    """One checkpoint of the trained models: float32 weights and AdamW's two moments, 12 bytes a parameter, for the
    actor and a critic like it (0 with LoRA: its adapters are small). `rlx ppo` counts the built models' parameters
    (rundir.checkpoint_bytes) before step 1."""
    return 0 if work.has_lora else CHECKPOINT_BYTES_PER_PARAM * shape.params * (2 if work.has_critic else 1)


def _what_fits(shape: ModelShape, work: Workload, base: Settings, user: dict, world: int, gpu_gib: float,
               host: Host | None = None) -> str:  # fmt: skip
    """The sentence naming what would fit: the user's own settings left to the plan, no reference, LoRA, CPU offload,
    more GPUs (as many ranks per host)."""
    hints = []
    if any(key in user for key in _CHOICES) and plan_fits(shape, work, base, {}, world, gpu_gib, host):
        given = ", ".join(f"{k}={_literal(user[k])}" for k in _CHOICES if k in user)
        hints.append(f"leave out {given} (the plan would choose)")
    if work.use_ref and plan_fits(shape, replace(work, use_ref=False), base, user, world, gpu_gib, host):
        hints.append("use_ref=false (no KL terms: the reference's whole float32 copy per rank is gone)")
    lora = replace(work, has_lora=True, use_ref=False)
    if not work.has_lora and plan_fits(shape, lora, base, user, world, gpu_gib, host):
        hints.append("a [lora] table (adapters trained on a frozen bfloat16 base, docs/lora.md)")
    if not work.launched and plan_fits(shape, replace(work, launched=True), base, user, world, gpu_gib, host):
        hints.append(
            "`torchrun --nproc_per_node 1 -m rlx ppo ...` with train.param_offload = true (FSDP keeps the float32 "
            "weights, gradients and AdamW on the CPU: slower steps)"
        )
    for more in (2 * world, 4 * world, 8 * world, 16 * world):  # several GPUs always run under a launcher
        if plan_fits(shape, replace(work, launched=True), base, user, more, gpu_gib, host):
            hints.append(f"{more} GPUs of {gpu_gib:.0f} GiB")
            break
    would = "; ".join(hints) if hints else "a larger device (nothing tried fits)"
    return f"nothing fits {world} x {gpu_gib:.0f} GiB; would fit: {would}"


def plan_fits(shape: ModelShape, work: Workload, base: Settings, user: dict, world: int, gpu_gib: float,
              host: Host | None) -> bool:  # fmt: skip
    """Whether some plan fits: the ladder, then a smaller KV cache."""
    if _search(shape, work, base, user, world, gpu_gib, host).fits:
        return True
    return _smaller_cache(shape, work, base, user, world, gpu_gib, host) is not None


def _host_message(shape: ModelShape, work: Workload, settings: Settings, world: int, gpu_gib: float, host: Host) -> str:
    """Why the host does not hold a run its GPUs would (with `settings`, the GPUs' plan): its peaks, and the host
    memory or the ranks per host that would."""
    peaks = host_gib(shape, work, settings, world, host.ranks)
    what = "the policy" + (", its reference" if work.use_ref else "") + (", a critic" if work.has_critic else "")
    need = max(peaks.values()) / (1 - HOST_RESERVED_SHARE)
    who = "rank 0 builds" if _rank0_loads(work, settings, world) else f"each of its {host.ranks} ranks builds"
    fewer = [r for r in range(host.ranks - 1, 0, -1) if host.ranks % r == 0 and world % r == 0]
    fits = [r for r in fewer if _host_fits(shape, work, settings, world, replace(host, ranks=r))]
    hints = [f"hosts of {math.ceil(need)} GiB"]
    if fits:
        hints.append(f"{fits[0]} rank{'s' if fits[0] > 1 else ''} per host ({world // fits[0]} hosts)")
    return (
        f"{world} x {gpu_gib:.0f} GiB GPUs would hold the run but the host would not: peak GiB per host load "
        f"{peaks['load']:.0f} ({who} {what} in float32 on the host before sharding: "
        f"{_loaded_gib(shape, work):.0f} GiB), steady {peaks['steady']:.0f} (checkpoint buffers"
        + (", offloaded shards" if settings.param_offload else "")
        + f"), of {host.usable_gib:.0f} usable of {host.memory_gib:.0f}; would fit: {'; '.join(hints)}"
    )


# --- from a recipe ----------------------------------------------------------------------------------------------


def plan_recipe(
    tree: dict, recipe_dir, world: int, gpu_memory_gib: float, host: Host | None = None, launched: bool = False
) -> MemoryPlan:
    """The plan of a recipe tree (after --set) on `world` GPUs of `gpu_memory_gib` (on hosts of `host`, None: not
    checked; `launched`: under torchrun, which lets one process offload): the fast path's keys filled in as `rlx ppo`
    does on CUDA, the recipe's own keys kept. UserError when
    the model's config.json cannot be read (a GGUF file, a package, a URL) or the recipe trains on megatron or
    asynchronously (not planned yet)."""
    from rlx.errors import UserError
    from rlx.ppo.defaults import apply_defaults, fast_path_defaults, model_config_of

    for table in ("megatron", "async"):
        if table in tree:
            raise UserError(f"the memory plan does not cover a recipe with [{table}] yet")
    tree = _old_tp_as_tp_degree(tree)
    config = model_config_of(tree, recipe_dir)
    where = (tree.get("model") or {}).get("path")
    if config is None:
        raise UserError(f"model.path {where!r}: the memory plan needs a local model folder with config.json")
    full = apply_defaults(tree, fast_path_defaults("cuda", tree, recipe_dir))
    user = {key: _lookup(tree, key) for key in _CHOICES if _lookup(tree, key) is not None}
    try:
        return plan_memory(config, full, user, world, gpu_memory_gib, host, launched)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{where}/config.json: cannot size the model for the memory plan ({e!r})") from None


def _old_tp_as_tp_degree(tree: dict) -> dict:
    """The tree with the deprecated rollout.tp as the rollout.tp_degree the recipe sets (RolloutConfig._take_old_tp):
    the plan keeps it, and chooses no degree that would conflict with it. Both given: as it is (the recipe's check
    refuses different values)."""
    rollout = tree.get("rollout")
    if not isinstance(rollout, dict) or not rollout.get("tp") or "tp_degree" in rollout:
        return tree
    moved = {k: v for k, v in rollout.items() if k != "tp"}
    return {**tree, "rollout": {**moved, "tp_degree": rollout["tp"]}}


def _lookup(tree: dict, dotted: str) -> Any:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def plan_overrides(plan: MemoryPlan, tree: dict) -> list[str]:
    """The plan's choices as `--set` overrides (a critic trains as the actor does: its keys follow the actor's)."""
    chosen = dict(plan.chosen)
    if isinstance(tree.get("critic"), dict):
        for key, value in plan.chosen.items():
            critic_key = "critic." + key
            if key.startswith("train.") and _lookup(tree, critic_key) is None:
                chosen[critic_key] = value
    return [f"{key}={_literal(value)}" for key, value in chosen.items()]


def saved_choices(recipe_json, tree: dict) -> list[str]:
    """A resumed run's memory settings as it started (from its recipe.json), for the keys `tree` leaves unset, as
    `--set` overrides (the plan is not made again: a resumed run must equal the one it continues)."""
    import json
    from pathlib import Path

    saved = json.loads(Path(recipe_json).read_text())
    keys = [*_CHOICES, *(f"critic.{k}" for k in _CHOICES if k.startswith("train.") and "critic" in tree)]
    return [
        f"{k}={_literal(_lookup(saved, k))}" for k in keys if _lookup(tree, k) is None and _lookup(saved, k) is not None
    ]
