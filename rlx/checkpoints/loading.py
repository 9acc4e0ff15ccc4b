"""Models from any source a command accepts: a Hugging Face dir, a GGUF file, or an rlx checkpoint of any layout.

A folder that is a Hugging Face model dir loads with transformers' `from_pretrained`; a checkpoint of another
layout is built from its config.json and given the full weights its layout reads. `rlx shard`, `rlx train-step`,
`rlx score`, `rlx rollout` and `rlx ppo` all load through here, so the driver and the separate commands start
from bit-identical weights.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import torch

from rlx.checkpoints.files import aux_files, generated_aux
from rlx.checkpoints.registry import is_hf_dir, read_full_weights, read_lora, read_meta_or_default
from rlx.errors import UserError
from rlx.models.family import family_of
from rlx.models.loading import (
    ModelSource,
    check_weights_match,
    init_random_model,
    load_causal_lm,
    load_config,
    load_tokenizer,
    model_class,
    quiet_transformers,
    resolve_source,
    weight_files,
)
from rlx.models.value import build_value_model, check_value_config, load_value_model

_MODEL_FILES = ("config.json", "generation_config.json")  # the policy's own; a critic's config is written anew


def load_model(
    source: ModelSource,
    role: str = "actor",
    dtype: torch.dtype | None = torch.float32,
    adapters: bool = False,
    config=None,
):
    """The causal LM (role 'actor') or value model (role 'critic') of `source`, on the CPU in `dtype`. A LoRA
    checkpoint gives its merged weights, or with `adapters` its base (in `dtype`) with the adapters in as PEFT
    layers (float32): what the trainer computed with. `config`: the source's config where the caller has read it
    (else it is read here, once)."""
    if config is None and (role == "critic" or not source.is_gguf):  # a GGUF policy needs none (seconds to convert)
        config = load_config(source)
    if role == "critic":
        check_value_config(config, source.path)
    lora = read_lora(source.path) if adapters and not source.is_gguf else None
    if lora is not None:
        return lora.build_model(dtype or torch.float32)
    if source.is_gguf or is_hf_dir(source.path):
        if role == "critic":
            return load_value_model(source, config, dtype)
        return load_causal_lm(source, config, dtype)
    model = unfilled_model(source, role, config)  # not drawn: every tensor is read below (check_weights_match)
    weights = read_full_weights(source.path, config)
    check_weights_match(model, weights, source.path)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    return model.to(dtype) if dtype is not None else model


def unfilled_model(source: ModelSource, role: str, config) -> torch.nn.Module:
    """The model of a checkpoint's config (float32, CPU) with its weights neither read nor drawn (the memory as
    allocated; buffers computed as usual): for a sharded trainer whose ranks each read their own shards of the
    weights into it afterwards (rlx.checkpoints.registry.read_shards), or `load_model` the whole of them."""
    from transformers.initialization import no_init_weights

    if role == "critic":
        check_value_config(config, source.path)
    quiet_transformers()
    config = copy.deepcopy(config)  # the model keeps (and may change) its own
    with no_init_weights():
        model = model_class(config, role).from_config(config, dtype=torch.float32)
    model.tie_weights()
    load_generation_config(model, source.path)
    return model


def load_generation_config(model, folder: Path) -> None:
    """Give a model built from its config the folder's generation_config.json, as `from_pretrained` does: its EOS
    ids (a list such as Llama 3's [<|end_of_text|>, <|eot_id|>]) end responses, where config.json may name one."""
    from transformers import GenerationConfig

    if not (Path(folder) / "generation_config.json").is_file():
        return
    try:
        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise UserError(f"{Path(folder) / 'generation_config.json'}: cannot be read ({e})") from None


def load_processor(source: ModelSource, options=None, config=None):
    """The image processor + tokenizer of a vision-language model (`VisionProcessor`, with a `VisionConfig`'s
    pixel limits), or None for a text-only model; a vision-language model dir without its processor files
    (preprocessor_config.json, or processor_config.json as transformers 5 writes it) is a UserError naming it."""
    from rlx.models.vision.processor import vision_processor_for

    if source.is_gguf:
        return None
    config = config if config is not None else load_config(source)
    return vision_processor_for(source.folder, config, options) if family_of(config).takes_images else None


def load_initial_policy(path: str | Path | ModelSource, init: str = "pretrained", seed: int = 0, config=None):
    """(model float32 on CPU, tokenizer, aux files) for a training start point.

    init='pretrained' loads the weights of an HF dir, checkpoint or GGUF file; init='random'
    initialises from the folder's config.json with `seed` (weights in the folder are ignored). `path` may be the
    source a stage resolved already, and `config` its config where read.
    """
    source = path if isinstance(path, ModelSource) else resolve_source(path)
    check_init(source, init)
    tokenizer = load_tokenizer(source)
    if init == "random":
        model = init_random_model(copy.deepcopy(config) if config is not None else load_config(source), seed)
        load_generation_config(model, source.folder)
        return model, tokenizer, aux_files(source.folder)
    if init != "pretrained":
        raise UserError(f"unknown init {init!r} (expected 'pretrained' or 'random')")
    model = load_model(source, config=config)
    aux = generated_aux(model, tokenizer) if source.is_gguf else aux_files(source.folder)
    return model, tokenizer, aux


def check_init(source: ModelSource, init: str) -> None:
    """Refuse init 'random' where it would silently throw trained weights away: a GGUF file (no config.json
    folder) or an rlx checkpoint that training wrote (step >= 1)."""
    if init != "random":
        return
    if source.is_gguf:
        raise UserError(f"{source.path}: init 'random' needs a folder with config.json, not a GGUF file")
    step = read_meta_or_default(source.path).step
    if step >= 1:
        raise UserError(
            f"{source.path}: a trained checkpoint (step {step}), but init 'random' would start from new random "
            f"weights; use init 'pretrained' to start from its weights, or give the folder with only config.json "
            f"and the tokenizer"
        )


def build_critic_files(
    policy, tokenizer, seed: int, policy_aux: dict[str, bytes] | None = None, unfilled: bool = False
) -> tuple[torch.nn.Module, dict[str, bytes]]:
    """A value model from `policy` (backbone copied, head seeded; `unfilled`: neither, see build_value_model) and its
    config/tokenizer files; a vision-language critic keeps the policy's own files (`policy_aux`: tokenizer, chat
    template, image processor) byte for byte with its config.json in place of the policy's, so its checkpoints read
    their batches' images as the policy's do."""
    critic = build_value_model(policy, seed, unfilled)
    aux = generated_aux(critic, tokenizer)
    if family_of(critic.config).takes_images and policy_aux:
        aux = {**{k: v for k, v in policy_aux.items() if k not in _MODEL_FILES}, "config.json": aux["config.json"]}
    return critic, aux


def checkpoint_weights(folder: Path, tied: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a model dir or checkpoint, read one file at a time from a Hugging Face dir (a
    checkpoint of another layout is gathered whole first). With `tied` embeddings the files hold no lm_head;
    it is given as the embedding (a consumer that expects every weight, e.g. vLLM's reload, needs it)."""
    from safetensors import safe_open

    if not is_hf_dir(folder):
        weights = read_full_weights(folder)
        for name, tensor in weights.items():
            yield name, tensor
            if tied and name == "model.embed_tokens.weight" and "lm_head.weight" not in weights:
                yield "lm_head.weight", tensor
        return
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())  # safe_open is not a mapping
            for name in names:
                tensor = f.get_tensor(name)
                yield name, tensor
                if tied and name == "model.embed_tokens.weight" and "lm_head.weight" not in names:
                    yield "lm_head.weight", tensor


class CheckpointWeights:
    """A rollout engine's WeightSource reading a model dir or checkpoint from disk (rollout.weight_sync = 'disk')."""

    module = None

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def named_weights(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        tied = bool(getattr(load_config(ModelSource(self.folder)), "tie_word_embeddings", False))
        return checkpoint_weights(self.folder, tied)

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        """A LoRA checkpoint's adapters as stored (the engine holds the base); None for full weights."""
        lora = read_lora(self.folder)
        return lora.tensors() if lora is not None else None
