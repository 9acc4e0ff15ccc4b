"""The fast path by default on GPUs: what `rlx ppo` sets on CUDA for the recipe keys a recipe leaves out (no torch
import: a pure function of the device type and the recipe; users opt out by setting a key, e.g.
`--set rollout.engine=hf` or `--set train.compile=false`). On the CPU (and on NPUs) the simple path stays."""

from __future__ import annotations

from typing import Any

_ALWAYS: dict[tuple[str, ...], Any] = {
    ("rollout", "engine"): "native",  # paged KV cache, continuous batching, CUDA graphs
    ("train", "use_packing"): True,  # no padding in the forward/backward
    ("train", "max_tokens_per_micro_batch"): 32768,  # micro-batches by token budget
    ("score", "use_packing"): True,
    ("score", "max_tokens_per_micro_batch"): 32768,
}
_WITHOUT_MEGATRON: dict[tuple[str, ...], Any] = {
    ("train", "compile"): True,  # the decoder layers fused by torch.compile (cached under $RLX_CACHE)
}


def fast_path_defaults(device_type: str, recipe: dict) -> dict[str, Any]:
    """{dotted key: value} to set for the keys `recipe` (the TOML tree after --set) leaves out, on `device_type`.
    The fused Triton logprobs are already the default on CUDA (logprob_impl 'auto')."""
    if device_type != "cuda":
        return {}
    chosen = dict(_ALWAYS)
    if "megatron" not in recipe:
        chosen.update(_WITHOUT_MEGATRON)
    if isinstance(recipe.get("critic"), dict):  # the critic trains as the actor does
        chosen.update({("critic", "train", *key[1:]): v for key, v in chosen.items() if key[0] == "train"})
    return {".".join(key): value for key, value in chosen.items() if not _has(recipe, key)}


def async_defaults(recipe: dict) -> dict[str, Any]:
    """{dotted key: value} for an asynchronous recipe ([async] with max_staleness > 0) that leaves the rollout
    correction out: token-level truncated importance sampling (train.rollout_is = "token"), since its samples
    come from older policies. Measured on the quickstart (bench/RESULTS.md, "Asynchronous rlx ppo"): without it
    the async run's reward over its last 20 steps was 0.53, with it 0.67, the synchronous run's 0.73."""
    table = recipe.get("async", recipe.get("async_"))
    if not isinstance(table, dict) or table.get("max_staleness", 1) == 0 or _has(recipe, ("train", "rollout_is")):
        return {}
    return {"train.rollout_is": "token"}


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
