"""The 'megatron' layout: one megatron-core state per tensor x pipeline rank.

    CKPT/
      rlx.json                              layout "megatron", tp_degree, pp_degree, step, ... (CheckpointMeta)
      config.json, tokenizer...             Hugging Face files, byte for byte from the source (as the other layouts)
      mp_rank_TT_PPP/model.safetensors      the state of tensor rank TT, pipeline rank PPP, with the megatron
                                            names of rlx/models/megatron/convert.py (shards + index past 5GB)
      mp_rank_TT_PPP/optimizer.safetensors  that rank's AdamW state keyed '<param name>::<state key>', as
                                            optimizer.safetensors of the 'single' layout (after a train step)

TT is the tensor-parallel rank (2 digits) and PPP the pipeline rank (3 digits), as Megatron-LM names
its folders. Data-parallel replicas hold the same state, so only data-parallel rank 0 of each
(tp, pp) pair writes. `read_full_weights` gives the full Hugging Face weights to one process (`rlx
merge`, `rlx rollout`, `rlx score`, the Hugging Face trainers), and `read_rank_state` /
`read_rank_optimizer` reshard when asked for degrees other than those stored. Reading and converting
need no megatron-core. Saving is atomic: a temporary folder that rank 0 renames once all ranks wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlx.checkpoints.base import CheckpointPart, Layout, LocalState, ShardOptions
from rlx.checkpoints.files import (
    OPTIMIZER_NAME,
    with_config_dtype,
    write_aux,
    write_optimizer_state,
    write_weights,
)
from rlx.checkpoints.meta import META_NAME, CheckpointMeta
from rlx.errors import UserError
from rlx.models.loading import (
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    ModelSource,
    build_empty_model,
    check_weights_match,
    load_config,
    read_safetensors,
    read_stored_weights,
)
from rlx.models.megatron.convert import hf_to_megatron, hf_to_megatron_shard, megatron_to_hf
from rlx.models.megatron.model import check_supported
from rlx.parallel.dist import barrier, broadcast_object
from rlx.utils.io import atomic_dir, exists, is_remote

RANK_DIR = "mp_rank_{tp:02d}_{pp:03d}"
_SEP = "::"


def rank_dir(tp_rank: int, pp_rank: int) -> str:
    """The folder name of rank (tp_rank, pp_rank): 'mp_rank_TT_PPP'."""
    return RANK_DIR.format(tp=tp_rank, pp=pp_rank)


def _read_meta(folder: Path) -> CheckpointMeta:
    meta = CheckpointMeta.read(folder)
    if meta.layout != "megatron":
        raise UserError(f"{folder / META_NAME}: layout {meta.layout!r}, expected a 'megatron' checkpoint")
    MegatronLayout().check_meta(meta, folder / META_NAME)
    return meta


def _check_rank(tp_rank: int, pp_rank: int, tp_degree: int, pp_degree: int) -> None:
    if not (0 <= tp_rank < tp_degree and 0 <= pp_rank < pp_degree):
        raise ValueError(f"rank (tp {tp_rank}, pp {pp_rank}) is outside tp {tp_degree} x pp {pp_degree}")


def check_complete(folder: str | Path) -> CheckpointMeta:
    """The checkpoint's meta, after checking that every rank's weights are there (before any process
    group is set up, so a broken checkpoint fails alike everywhere)."""
    folder = Path(folder)
    meta = _read_meta(folder)
    for pp_rank in range(meta.pp_degree):
        for tp_rank in range(meta.tp_degree):
            sub = folder / rank_dir(tp_rank, pp_rank)
            if not (sub / WEIGHTS_NAME).is_file() and not (sub / WEIGHTS_INDEX_NAME).is_file():
                raise UserError(
                    f"{sub / WEIGHTS_NAME}: missing (checkpoint written with tp {meta.tp_degree}, pp {meta.pp_degree})"
                )
    return meta


def _stored_rank_weights(folder: Path, meta: CheckpointMeta, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
    sub = folder / rank_dir(tp_rank, pp_rank)
    if not (sub / WEIGHTS_NAME).is_file() and not (sub / WEIGHTS_INDEX_NAME).is_file():
        raise UserError(
            f"{sub / WEIGHTS_NAME}: missing (checkpoint written with tp {meta.tp_degree}, pp {meta.pp_degree})"
        )
    return read_stored_weights(sub)  # megatron's own names, never converted


def read_rank_state(
    folder: str | Path, tp_rank: int, pp_rank: int, *, tp_degree: int | None = None, pp_degree: int | None = None
) -> dict[str, torch.Tensor]:
    """The megatron state of rank (tp_rank, pp_rank), as stored (dtype kept).

    With `tp_degree` / `pp_degree` other than the stored ones, the state is cut from the full weights
    instead (every rank then reads every shard once)."""
    folder = Path(folder)
    meta = _read_meta(folder)
    tp, pp = tp_degree or meta.tp_degree, pp_degree or meta.pp_degree
    _check_rank(tp_rank, pp_rank, tp, pp)
    if (tp, pp) == (meta.tp_degree, meta.pp_degree):
        return _stored_rank_weights(folder, meta, tp_rank, pp_rank)
    config = load_config(ModelSource(folder))
    check_supported(config, tp, pp, where=str(folder))
    return hf_to_megatron_shard(read_full_weights(folder), config, tp, pp, tp_rank, pp_rank)


def read_rank_optimizer(
    folder: str | Path, tp_rank: int, pp_rank: int, *, tp_degree: int | None = None, pp_degree: int | None = None
) -> dict[str, torch.Tensor] | None:
    """The AdamW state of rank (tp_rank, pp_rank) keyed '<param name>::<state key>', or None when the
    checkpoint has none (a fresh `rlx shard`). Resharded like `read_rank_state` for other degrees."""
    folder = Path(folder)
    meta = _read_meta(folder)
    tp, pp = tp_degree or meta.tp_degree, pp_degree or meta.pp_degree
    _check_rank(tp_rank, pp_rank, tp, pp)
    if not (folder / rank_dir(0, 0) / OPTIMIZER_NAME).is_file():
        return None
    if (tp, pp) == (meta.tp_degree, meta.pp_degree):
        return _stored_rank_optimizer(folder, meta, tp_rank, pp_rank)
    stored = {
        (t, p): _stored_rank_optimizer(folder, meta, t, p) for p in range(meta.pp_degree) for t in range(meta.tp_degree)
    }
    config = load_config(ModelSource(folder))
    check_supported(config, tp, pp, where=str(folder))
    return _reshard_optimizer(stored, config, (meta.tp_degree, meta.pp_degree), (tp, pp, tp_rank, pp_rank))


def _stored_rank_optimizer(folder: Path, meta: CheckpointMeta, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
    path = folder / rank_dir(tp_rank, pp_rank) / OPTIMIZER_NAME
    if not path.is_file():
        raise UserError(f"{path}: missing (checkpoint written with tp {meta.tp_degree}, pp {meta.pp_degree})")
    return read_safetensors(path)


def _reshard_optimizer(stored: dict, config, source: tuple[int, int], target: tuple[int, int, int, int]) -> dict:
    """AdamW tensors are shaped like their parameters, so each state key goes through the weight maps;
    scalar entries (the step count) are the same for every parameter and are copied."""
    tp, pp, tp_rank, pp_rank = target
    by_key: dict[str, dict] = {}
    for rank, state in stored.items():
        for name, tensor in state.items():
            param, _, key = name.rpartition(_SEP)
            by_key.setdefault(key, {}).setdefault(rank, {})[param] = tensor
    out, scalars = {}, {}
    for key, shards in by_key.items():
        sample = next(iter(shards[(0, 0)].values()))
        if sample.dim() == 0:
            scalars[key] = sample
            continue
        full = megatron_to_hf(shards, config, *source)
        for param, tensor in hf_to_megatron_shard(full, config, tp, pp, tp_rank, pp_rank).items():
            out[f"{param}{_SEP}{key}"] = tensor
    params = {name.rpartition(_SEP)[0] for name in out}
    for key, value in scalars.items():
        out.update({f"{param}{_SEP}{key}": value.clone() for param in params})
    return out


def read_full_weights(folder: str | Path, config=None) -> dict[str, torch.Tensor]:
    """The full Hugging Face weights of a 'megatron' checkpoint (every shard read; stored dtypes kept); `config`:
    its config where the caller has read it."""
    folder = Path(folder)
    meta = _read_meta(folder)
    config = config if config is not None else load_config(ModelSource(folder))
    check_supported(config, meta.tp_degree, meta.pp_degree, where=str(folder))
    shards = {
        (t, p): _stored_rank_weights(folder, meta, t, p) for p in range(meta.pp_degree) for t in range(meta.tp_degree)
    }
    try:
        weights = megatron_to_hf(shards, config, meta.tp_degree, meta.pp_degree)
    except (UserError, RuntimeError) as e:
        raise UserError(f"{folder}: megatron shards do not fit config.json ({str(e).splitlines()[0]})") from None
    check_weights_match(build_empty_model(config), weights, folder)
    return weights


def _check_meta(meta: CheckpointMeta) -> None:
    if meta.layout != "megatron" or not meta.tp_degree or not meta.pp_degree:
        raise ValueError(f"a megatron checkpoint needs layout 'megatron', tp_degree and pp_degree (got {meta})")


def write_rank(
    folder: Path,
    tp_rank: int,
    pp_rank: int,
    state: dict[str, torch.Tensor],
    optimizer_state: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write one rank's folder (mp_rank_TT_PPP) inside a checkpoint's (temporary) folder."""
    sub = folder / rank_dir(tp_rank, pp_rank)
    sub.mkdir()
    write_weights(sub, state)
    if optimizer_state is not None:
        write_optimizer_state(sub, optimizer_state)


def save_megatron_checkpoint(
    out: str | Path,
    rank_states: dict[tuple[int, int], dict[str, torch.Tensor]],
    aux: dict[str, bytes],
    meta: CheckpointMeta,
    overwrite: bool = False,
    optimizer_states: dict[tuple[int, int], dict[str, torch.Tensor]] | None = None,
) -> None:
    """Write a whole 'megatron' checkpoint from one process (`rlx shard`): {(tp_rank, pp_rank): state}
    for every rank of `meta`'s degrees, and optionally their optimizer states."""
    _check_meta(meta)
    expected = {(t, p) for p in range(meta.pp_degree) for t in range(meta.tp_degree)}
    if set(rank_states) != expected:
        raise ValueError(f"rank states {sorted(rank_states)} do not cover tp {meta.tp_degree} x pp {meta.pp_degree}")
    with atomic_dir(out, overwrite=overwrite, marker=META_NAME) as tmp:
        for (t, p), state in sorted(rank_states.items()):
            write_rank(tmp, t, p, state, (optimizer_states or {}).get((t, p)))
        write_aux(tmp, with_config_dtype(aux, rank_states[0, 0]))  # the dtype the shards are written in
        meta.write(tmp)


@dataclass
class RankContent:
    """What one rank writes into a megatron checkpoint (and rank 0 the shared files)."""

    state: dict[str, torch.Tensor]
    optimizer_state: dict[str, torch.Tensor] | None
    aux: dict[str, bytes]
    meta: CheckpointMeta


def save_megatron_rank_checkpoint(
    out: str | Path,
    state: dict[str, torch.Tensor],
    optimizer_state: dict[str, torch.Tensor] | None,
    aux: dict[str, bytes],
    meta: CheckpointMeta,
    ctx,
    tp_rank: int,
    pp_rank: int,
    dp_rank: int,
    overwrite: bool = False,
    nested: dict[str, RankContent] | None = None,
    before_publish: Callable[[], None] | None = None,
) -> None:
    """Write a 'megatron' checkpoint, collectively: every rank of the launch calls this with its own
    state; data-parallel rank 0 of each (tp, pp) writes it, rank 0 writes `aux` and rlx.json and
    publishes the folder once every rank is done. Alone (no launcher), it just writes.

    `nested`: sub-checkpoints (e.g. 'critic') of the same degrees, written the same way inside the
    folder; `before_publish()` runs on rank 0 after every file is written, before the rename."""
    contents = {"": RankContent(state, optimizer_state, aux, meta), **(nested or {})}
    for content in contents.values():
        _check_meta(content.meta)
        _check_rank(tp_rank, pp_rank, content.meta.tp_degree, content.meta.pp_degree)
    if ctx.world > 1 and is_remote(out):
        raise UserError(f"{out}: several processes write the megatron layout to local (or mounted) storage only")
    if exists(out) and not overwrite:  # every rank fails alike, before any collective
        raise UserError(f"{out}: already exists (choose another output or pass --overwrite)")
    publish = atomic_dir(out, overwrite=overwrite, marker=META_NAME) if ctx.is_main else contextlib.nullcontext()
    with publish as tmp:  # rank 0 renames the folder into place after every rank has written
        tmp = Path(broadcast_object(str(tmp) if ctx.is_main else None))
        if ctx.is_main:
            for name in contents:
                (tmp / name).mkdir(exist_ok=True)
        barrier()
        if dp_rank == 0:
            for name, content in contents.items():
                write_rank(tmp / name, tp_rank, pp_rank, content.state, content.optimizer_state)
        barrier()
        if ctx.is_main:
            for name, content in contents.items():
                write_aux(tmp / name, with_config_dtype(content.aux, content.state))  # rank 0's shards' dtype
                content.meta.write(tmp / name)
            if before_publish is not None:
                before_publish()
    barrier()  # published before any rank goes on


def name_architecture(config, aux: dict[str, bytes]):
    """(config, aux) with `architectures` set: GGUF configs name none, and this layout needs it (it picks the
    model family when the checkpoint is read back)."""
    if getattr(config, "architectures", None):
        return config, aux
    import copy
    import json

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = copy.deepcopy(config)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, type(config).__name__)]
    if "config.json" in aux:
        data = {**json.loads(aux["config.json"]), "architectures": config.architectures}
        aux = {**aux, "config.json": (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()}
    return config, aux


class MegatronLayout(Layout):
    name = "megatron"
    backend = "megatron"

    shard_options = ("tp_degree", "pp_degree")

    def shard_fields(self, options: ShardOptions) -> dict:
        def given(value):
            return 1 if value is None else value

        return {"tp_degree": given(options.tp_degree), "pp_degree": given(options.pp_degree)}

    def check_meta(self, meta: CheckpointMeta, path: Path) -> None:
        for name in ("tp_degree", "pp_degree"):
            value = getattr(meta, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"{path}: layout 'megatron' needs '{name}' (a positive integer), got {value!r}")

    def check_model(self, config, fields: dict, where: str) -> None:
        config = name_architecture(config, {})[0]
        check_supported(config, fields["tp_degree"], fields["pp_degree"], where=where)

    def prepare_files(self, config, aux: dict[str, bytes]):
        return name_architecture(config, aux)

    def check_complete(self, folder: Path) -> None:
        check_complete(folder)

    def read_full_weights(self, folder: Path, config=None) -> dict[str, torch.Tensor]:
        return read_full_weights(folder, config)

    def read_local_state(self, folder: Path, kind: str, coords: dict[str, int]) -> LocalState:
        if kind != "megatron":
            return super().read_local_state(folder, kind, coords)
        grid = {"tp_degree": coords.get("tp_degree"), "pp_degree": coords.get("pp_degree")}
        tp_rank, pp_rank = coords["tp_rank"], coords["pp_rank"]
        return LocalState(
            kind,
            read_rank_state(folder, tp_rank, pp_rank, **grid),
            read_rank_optimizer(folder, tp_rank, pp_rank, **grid),
            coords,
        )

    def write_full(self, out, weights, aux, meta, config, overwrite) -> None:
        check_supported(config, meta.tp_degree, meta.pp_degree, where=str(out))
        shards = hf_to_megatron(weights, config, meta.tp_degree, meta.pp_degree)
        save_megatron_checkpoint(out, shards, aux, meta, overwrite=overwrite)

    def write(
        self, out: str, parts: dict[str, CheckpointPart], overwrite: bool, before_publish: Callable | None = None
    ) -> None:
        contents, coords, state = {}, None, parts[""].state
        for name, part in parts.items():
            local = part.state.local_state()
            if local.kind != "megatron":
                raise UserError(f"{out}: the megatron layout stores megatron-core stages, not '{local.kind}' state")
            coords = local.coords
            degrees = {"layout": self.name, "tp_degree": coords["tp_degree"], "pp_degree": coords["pp_degree"]}
            meta = dataclasses.replace(part.meta, **degrees)
            contents[name] = RankContent(local.weights, local.optimizer, part.aux, meta)
        main = contents.pop("")
        save_megatron_rank_checkpoint(
            out, main.state, main.optimizer_state, main.aux, main.meta, state, coords["tp_rank"], coords["pp_rank"],
            coords["dp_rank"], overwrite=overwrite, nested=contents, before_publish=before_publish,
        )  # fmt: skip
