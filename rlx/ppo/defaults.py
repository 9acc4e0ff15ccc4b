"""The fast path by default on GPUs: what `rlx ppo` sets on CUDA for the recipe keys a recipe leaves out (no torch
import: a pure function of the device type and the recipe; users opt out by setting a key, e.g.
`--set rollout.engine=hf` or `--set train.compile=false`). On the CPU (and on NPUs) the simple path stays."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlx.observe.flops import MOE_KEYS

_ALWAYS: dict[tuple[str, ...], Any] = {
    ("rollout", "engine"): "native",  # paged KV cache, continuous batching, CUDA graphs
    ("train", "use_packing"): True,  # no padding in the forward/backward
    ("train", "max_tokens_per_micro_batch"): 32768,  # micro-batches by token budget
    ("score", "use_packing"): True,
    ("score", "max_tokens_per_micro_batch"): 32768,
    ("score", "old_logprobs"): "auto",  # one update per batch: from the train step's forward, no score forward
}
_WITHOUT_MEGATRON: dict[tuple[str, ...], Any] = {
    ("train", "compile"): True,  # the decoder layers fused by torch.compile (cached under $RLX_CACHE)
}


# The token budget of a micro-batch is 32,768 for the 0.5B shape it was measured on (bench/RESULTS.md, "Whole GRPO
# steps"); a wider or deeper model keeps the activations of a micro-batch near the same memory by taking fewer
# tokens, in proportion to layers x (2 x hidden + intermediate) (a Qwen2-VL-2B-shaped model: 15,360 tokens; at 32,768
# its train step ran out of an H100's 80 GB). Never more than 32,768; a model whose config cannot be read keeps it.
_BUDGET_TOKENS = 32768
_BUDGET_REFERENCE = 24 * (2 * 896 + 4864)


def micro_batch_token_budget(model_config: dict | None) -> int:
    """The fast path's tokens per packed micro-batch for a model with this config.json (None: the reference)."""
    text = (model_config or {}).get("text_config") or model_config or {}
    try:
        layers, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
        intermediate = int(text.get("intermediate_size") or 4 * hidden)
    except (KeyError, TypeError, ValueError):
        return _BUDGET_TOKENS
    scaled = _BUDGET_TOKENS * _BUDGET_REFERENCE // max(1, layers * (2 * hidden + intermediate))
    return max(2048, min(_BUDGET_TOKENS, scaled // 1024 * 1024))


def model_config_of(recipe: dict, recipe_dir: Path | None) -> dict | None:
    """The config.json of the recipe's model folder, when it is a local folder (GGUF files, packages and URLs: None)."""
    value = recipe.get("model", {}).get("path") if isinstance(recipe.get("model"), dict) else None
    if not isinstance(value, str) or ":" in value:
        return None
    path = Path(value)
    if not path.is_absolute() and recipe_dir is not None and (recipe_dir / path).exists():
        path = recipe_dir / path
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None


def fast_path_defaults(device_type: str, recipe: dict, recipe_dir: Path | None = None) -> dict[str, Any]:
    """{dotted key: value} to set for the keys `recipe` (the TOML tree after --set) leaves out, on `device_type`;
    `recipe_dir` resolves a relative model path (its config.json sizes the micro-batch token budget). The fused
    Triton logprobs are already the default on CUDA (logprob_impl 'auto')."""
    if device_type != "cuda":
        return {}
    chosen = dict(_ALWAYS)
    budget = micro_batch_token_budget(model_config_of(recipe, recipe_dir))
    # exact mode takes the same budget: its fused Triton kernels keep the eager layers' activations near the compiled
    # ones' (the 0.5B train step at 32,768 tokens: 33.0 GiB, 0.400 s a step against 0.513 s at 16,384; RESULTS.md)
    chosen.update({key: budget for key in chosen if key[-1] == "max_tokens_per_micro_batch"})
    compiled = not _routed_experts(model_config_of(recipe, recipe_dir)) and not recipe.get("exact")
    if "megatron" not in recipe and compiled:  # exact mode runs its layers eagerly (docs/exact.md)
        chosen.update(_WITHOUT_MEGATRON)
    if isinstance(recipe.get("critic"), dict):  # the critic trains as the actor does
        chosen.update({("critic", "train", *key[1:]): v for key, v in chosen.items() if key[0] == "train"})
    return {".".join(key): value for key, value in chosen.items() if not _has(recipe, key)}


def _routed_experts(model_config: dict | None) -> bool:
    """A mixture-of-experts config: the fast path leaves train.compile off for it (on an H100, Inductor's backward of
    transformers' grouped-GEMM experts failed with an index assertion: bench/RESULTS.md, "Mixture of experts")."""
    text = (model_config or {}).get("text_config") or model_config or {}
    return any(text.get(key) for key in MOE_KEYS)


def async_defaults(recipe: dict) -> dict[str, Any]:
    """{dotted key: value} for an asynchronous recipe ([async] with max_staleness > 0) that leaves the rollout
    correction out: token-level truncated importance sampling (train.correction.rollout_is = "token"), since its
    samples come from older policies. Measured on the quickstart (bench/RESULTS.md, "Asynchronous rlx ppo"): without it
    the async run's reward over its last 20 steps was 0.53, with it 0.67, the synchronous run's 0.73."""
    table = recipe.get("async", recipe.get("async_"))
    if not isinstance(table, dict) or table.get("max_staleness", 1) == 0:
        return {}
    if _has(recipe, ("train", "correction", "rollout_is")):
        return {}
    return {"train.correction.rollout_is": "token"}


def _has(tree: dict, key: tuple[str, ...]) -> bool:
    for part in key:
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def apply_defaults(recipe: dict, values: dict[str, Any]) -> dict:
    """A copy of `recipe` with the dotted `values` set (tables created)."""
    import copy

    out = copy.deepcopy(recipe)
    for dotted, value in values.items():
        node = out
        *tables, last = dotted.split(".")
        for table in tables:
            node = node.setdefault(table, {})
        node[last] = value
    return out
