"""What a LoRA checkpoint says about its adapters and its base model (`lora.json`), and loading that base.

    lora.json = {"format_version": 1, "role": "actor" | "critic", "lora": LoraConfig, "base": LoraBase}

The base is named by the source it was loaded from (`path`, `init`, `seed`): a Hugging Face dir, an rlx checkpoint
of any layout, a GGUF file (`pkg:` and URLs kept as given), or a config initialised at random with a seed; a critic's
base may also be a causal LM that becomes a value model (its head is trained, so it is stored with the adapters). Its
identity (rlx.models.lora_state.base_identity: architecture, config, tensor shapes, a weights fingerprint) pins it:
a base that is missing or differs is a UserError naming the path or the difference.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from rlx.checkpoints.loading import load_initial_policy, load_model
from rlx.config import ConfigError, check, check_choices, from_dict, to_dict
from rlx.errors import UserError
from rlx.models.loading import PACKAGE_SCHEME, resolve_model
from rlx.models.lora_config import LoraConfig
from rlx.models.lora_state import base_identity, check_base_identity
from rlx.models.value import build_value_model, is_value_config
from rlx.utils.io import is_remote, read_json

LORA_FILE = "lora.json"
FORMAT_VERSION = 1


@dataclass(kw_only=True)
class LoraBase:
    """Where a LoRA checkpoint's frozen base model comes from, and what it must be."""

    path: str
    """The base model: a Hugging Face dir, an rlx checkpoint (any layout), a .gguf file, `pkg:...` or a URL; a
    config dir with a tokenizer for init 'random'. Local paths are absolute."""
    init: Literal["pretrained", "random"] = "pretrained"
    """'pretrained': the weights at `path`; 'random': initialised from its config.json with `seed`."""
    seed: int = 0
    """Seed of a random init, and of the value head when a critic's base is a causal LM."""
    identity: dict = field(default_factory=dict)
    """`base_identity` of the base weights: architecture, config, tensor shapes, fingerprint."""

    def __post_init__(self) -> None:
        check_choices(self)
        check(bool(self.path), "path", "expected the base model's path")
        missing = {"architecture", "config", "shapes", "fingerprint"} - set(self.identity)
        check(not missing, "identity", f"lacks {', '.join(sorted(missing))}")


@dataclass
class LoraSpec:
    """Adapters on a frozen base: their settings, the base they belong to and its role (what a LoRA trainer carries)."""

    config: LoraConfig
    base: LoraBase
    role: str = "actor"
    """'actor' (a causal LM's adapters) or 'critic' (a value model's adapters and its trained head)."""


def source_path(path: str | Path) -> str:
    """How a checkpoint names a model source: `pkg:` and URLs as given, local paths absolute."""
    text = str(path)
    if text.startswith(PACKAGE_SCHEME) or is_remote(text):
        return text
    return str(Path(text).resolve())


def describe_base(path: str | Path, init: str, seed: int, model: torch.nn.Module) -> LoraBase:
    """The LoraBase of `model`, loaded from `path` with `init` and `seed` (call before adapters or sharding: the
    identity reads every base weight)."""
    return LoraBase(path=source_path(path), init=init, seed=seed, identity=base_identity(model))


def lora_spec(config: LoraConfig | None, path: str | Path, init: str, seed: int, model, role: str = "actor"):
    """The LoraSpec of adapters with `config` on `model` (loaded from path/init/seed), or None without a config."""
    return None if config is None else LoraSpec(config, describe_base(path, init, seed, model), role)


def load_base(base: LoraBase, role: str, where: str) -> torch.nn.Module:
    """The base model (float32, CPU) as it was when the adapters were made; UserError when it is missing or differs."""
    try:
        source, config = resolve_model(base.path, "base model")
        is_value_model = not source.is_gguf and is_value_config(config)
    except UserError as e:
        raise UserError(f"{where}: the adapters' base model is not available: {e}") from None
    if role == "critic" and is_value_model and base.init == "pretrained":
        model = load_model(source, "critic", config=config)
    else:
        model = load_initial_policy(source, base.init, base.seed, config)[0]
        if role == "critic":
            model = build_value_model(model, base.seed)
    check_base_identity(base.identity, model, f"{where} (base {base.path})")
    return model


def write_lora_json(folder: Path, spec: LoraSpec) -> None:
    data = {"format_version": FORMAT_VERSION, "role": spec.role}
    data.update(lora=to_dict(spec.config), base=to_dict(spec.base))
    (Path(folder) / LORA_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_lora_json(folder: Path) -> LoraSpec:
    """The LoraSpec in a LoRA checkpoint's lora.json; bad contents name the file and key."""
    path = Path(folder) / LORA_FILE
    data = read_json(path)
    if data.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{path}: format_version {data.get('format_version')!r} is not supported ({FORMAT_VERSION})")
    role = data.get("role")
    if role not in ("actor", "critic"):
        raise UserError(f"{path}: role: expected 'actor' or 'critic', got {role!r}")
    try:
        config = from_dict(LoraConfig, data.get("lora", {}), "lora")
        base = from_dict(LoraBase, data.get("base", {}), "base")
    except ConfigError as e:
        raise UserError(f"{path}: {e}") from None
    return LoraSpec(config, base, role)


def check_same_config(given: LoraConfig | None, stored: LoraConfig, where: str) -> None:
    """`--lora-*` options given for a LoRA checkpoint must agree with its adapters (they cannot change midway)."""
    if given is None:
        return
    for f in dataclasses.fields(LoraConfig):
        if getattr(given, f.name) != getattr(stored, f.name):
            raise UserError(
                f"{where}: its adapters have lora {f.name} = {getattr(stored, f.name)!r}, not "
                f"{getattr(given, f.name)!r} (leave the LoRA options out to continue them as they are)"
            )
