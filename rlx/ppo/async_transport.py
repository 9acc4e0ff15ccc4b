"""What crosses between rollout ranks and trainers in an asynchronous run (see rlx/parallel/roles.py).

Messages go through the launch's key-value store, so neither side blocks the other: a rollout rank `put`s the
batch of step s (its share of the step's records) and goes on generating; the lead trainer `take`s it when it
trains step s. Keys (under `rlx-async/`):

    start            {start_step, data_position}: where the trainers start (a resume continues its checkpoint)
    b/S/R            rollout rank R's share of step S's samples, with its generation statistics
    g/S/J/R          dynamic sampling: rollout rank R's count of informative groups in batch J of step S
    e/V/R            [eval]: rollout rank R's graded share of the held-out prompts under policy version V (EvalShare)
    w/V/I            the header of bucket I of policy version V: names, shapes and dtypes of its tensors
    stop             the trainers are done (or failed): rollout ranks exit

Weights go over the bridge process group: after the train step that makes version V the trainers drain their
`named_weights` together (FSDP shards all-gathered a bucket at a time); the lead casts each tensor to the rollout
dtype on its device, packs a bucket into one flat tensor per dtype, writes the bucket's header and broadcasts
the flat tensors. A rollout rank sees `w/V/0` between two engine steps (it polls), reads each header and joins
each broadcast: no disk, and on GPUs no trip through host memory.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterator

import torch

from rlx.parallel.roles import Roles, broadcast

PREFIX = "rlx-async/"
POLL_S = 0.005


class StopSignal(Exception):
    """The trainers are done (the `stop` key appeared while a rollout rank waited)."""


class Channel:
    """Pickled objects under keys of the launch's store, and waits that end with an error instead of hanging."""

    def __init__(self, store, timeout_s: float):
        self.store, self.timeout_s = store, timeout_s

    def put(self, key: str, obj) -> None:
        self.store.set(PREFIX + key, pickle.dumps(obj))

    def has(self, key: str) -> bool:
        return self.store.check([PREFIX + key])

    def delete(self, key: str) -> None:
        self.store.delete_key(PREFIX + key)

    def wait(self, key: str, what: str, stop_aware: bool = False, timeout_s: float | None = None,
             idle: Callable[[], None] | None = None) -> float:  # fmt: skip
        """Wait until `key` exists; the seconds waited. `stop_aware`: raise StopSignal if the trainers stop first;
        `idle` is called between polls. After $RLX_COLLECTIVE_TIMEOUT_S a RuntimeError names what was missing (the
        other side died or stalled)."""
        start = time.perf_counter()
        limit = self.timeout_s if timeout_s is None else timeout_s
        while not self.has(key):
            if stop_aware and self.has("stop"):
                raise StopSignal()
            waited = time.perf_counter() - start
            if waited > limit:
                raise RuntimeError(
                    f"timed out after {waited:.0f} s waiting for {what} (RLX_COLLECTIVE_TIMEOUT_S); that process "
                    f"probably failed or stalled: check its log"
                )
            if idle is not None:
                idle()
            time.sleep(POLL_S)
        return time.perf_counter() - start

    def take(self, key: str, what: str, keep: bool = False, stop_aware: bool = False):
        """The object under `key` once it exists (removed from the store unless `keep`)."""
        self.wait(key, what, stop_aware)
        obj = pickle.loads(self.store.get(PREFIX + key))
        if not keep:
            self.delete(key)
        return obj


def push_weights(roles: Roles, channel: Channel, version: int, source, bucket_bytes: int, dtype: torch.dtype) -> float:
    """Broadcast `source`'s weights (a trainer) as policy `version` to the rollout ranks; every trainer calls it
    (the shards are gathered among them), the lead sends. Returns the seconds it took."""
    start = time.perf_counter()
    bucket: list[tuple[str, torch.Tensor]] = []
    size, index = 0, 0
    for name, tensor in source.named_weights(bucket_bytes):
        if not roles.is_lead_trainer:
            continue
        tensor = tensor.detach().to(roles.device, dtype if tensor.is_floating_point() else tensor.dtype)
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            _send_bucket(roles, channel, version, index, bucket, last=False)
            bucket, size, index = [], 0, index + 1
    if roles.is_lead_trainer:
        _send_bucket(roles, channel, version, index, bucket, last=True)
        if version > 1:  # every rollout rank has joined all broadcasts of the version before the previous one
            for old in range(_header_count(channel, version - 2)):
                channel.delete(f"w/{version - 2}/{old}")
        channel.put(f"w/{version}/count", index + 1)
    return time.perf_counter() - start


def _header_count(channel: Channel, version: int) -> int:
    return pickle.loads(channel.store.get(PREFIX + f"w/{version}/count")) if channel.has(f"w/{version}/count") else 0


def _send_bucket(roles: Roles, channel: Channel, version: int, index: int, bucket, last: bool) -> None:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for _, tensor in bucket:
        groups.setdefault(tensor.dtype, []).append(tensor.reshape(-1))
    header = {
        "entries": [(name, tuple(t.shape), t.dtype) for name, t in bucket],
        "dtypes": list(groups),
        "last": last,
    }
    channel.put(f"w/{version}/{index}", header)
    for flats in groups.values():
        broadcast(roles.bridge, torch.cat(flats), roles.bridge_root)


class BroadcastWeights:
    """A rollout WeightSource: policy `version` as it arrives over the bridge (rollout ranks call
    `engine.update_weights(BroadcastWeights(...))` and then `drain()`, so every broadcast is joined)."""

    module = None

    def __init__(self, roles: Roles, channel: Channel, version: int):
        self.roles, self.channel, self.version = roles, channel, version
        self._stream: Iterator[tuple[str, torch.Tensor]] | None = None

    def named_weights(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        if self._stream is None:
            self._stream = self._receive()
        return self._stream

    def adapter_state(self) -> None:
        return None

    def drain(self) -> None:
        """Join whatever broadcasts of this version the engine did not read."""
        for _ in self.named_weights(0):
            pass

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        index, what = 0, f"the weights of policy version {self.version} from the first trainer"
        while True:
            header = self.channel.take(f"w/{self.version}/{index}", what, keep=True)
            flats = {}
            for dtype in header["dtypes"]:
                numel = sum(_numel(shape) for _, shape, d in header["entries"] if d == dtype)
                flat = torch.empty(numel, dtype=dtype, device=self.roles.device)
                broadcast(self.roles.bridge, flat, self.roles.bridge_root)
                flats[dtype] = flat
            offsets = dict.fromkeys(flats, 0)
            for name, shape, dtype in header["entries"]:
                n = _numel(shape)
                yield name, flats[dtype][offsets[dtype] : offsets[dtype] + n].view(shape)
                offsets[dtype] += n
            if header["last"]:
                return
            index += 1


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
