"""Paced safetensors writes (rlx.utils.tensor_files) and the ppo background writer that uses them: the files equal
safetensors' own, the pace makes the writer wait between chunks, and waiting for the writes lifts the pace."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rlx.ppo.writer import BackgroundWriter
from rlx.utils import tensor_files
from rlx.utils.tensor_files import Pace, paced, save_tensors, write_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(4, 2, generator=g).to(torch.bfloat16),
        "f16": torch.randn(7, generator=g).half(),
        "i64": torch.arange(6).reshape(2, 3),
        "i32": torch.arange(3, dtype=torch.int32),
        "u8": torch.tensor([1, 2, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(3, 4, generator=g).t(),  # not contiguous
    }


def test_files_read_back_as_safetensors_own(tmp_path):
    tensors = _tensors()
    write_safetensors(tmp_path / "mine.safetensors", tensors, {"format": "pt"})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "theirs.safetensors"), {"format": "pt"})
    mine, theirs = load_file(tmp_path / "mine.safetensors"), load_file(tmp_path / "theirs.safetensors")
    assert mine.keys() == theirs.keys() == tensors.keys()
    for key, value in tensors.items():
        assert mine[key].dtype == value.dtype and torch.equal(mine[key], theirs[key]) and torch.equal(mine[key], value)
    with safe_open(tmp_path / "mine.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    header = int.from_bytes((tmp_path / "mine.safetensors").read_bytes()[:8], "little")
    assert header % 8 == 0  # the data starts 8-byte aligned, as the format asks


class _Recorded(threading.Event):
    """An event that records the waits asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout=None) -> bool:
        self.waits.append(timeout)
        return super().wait(timeout)


def test_the_pace_makes_the_writer_wait_and_hurry_lifts_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tensor_files, "CHUNK_BYTES", 1 << 20)
    tensors = {"x": torch.zeros(4 << 20, dtype=torch.uint8)}  # 4 chunks of 1 MiB
    slow = Pace(8 << 20, _Recorded())  # 8 MiB/s: 0.5 s for the 4 MiB, far slower than any disk takes them
    write_safetensors(tmp_path / "slow.safetensors", tensors, pace=slow)
    assert len(slow.hurry.waits) >= 3 and sum(slow.hurry.waits) > 0.2
    hurried = Pace(1.0, _Recorded())  # 1 byte/s: without `hurry` this would take weeks
    hurried.hurry.set()
    write_safetensors(tmp_path / "hurried.safetensors", tensors, pace=hurried)
    assert hurried.hurry.waits == []
    assert torch.equal(load_file(tmp_path / "hurried.safetensors")["x"], tensors["x"])


def test_save_tensors_is_paced_only_inside_paced(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(tensor_files, "write_safetensors", lambda *a, **k: calls.append(a[3]))
    pace = Pace(2**30)
    save_tensors({"x": torch.ones(2)}, tmp_path / "plain.safetensors")
    with paced(pace):
        save_tensors({"x": torch.ones(2)}, tmp_path / "paced.safetensors")
        with paced(None):
            save_tensors({"x": torch.ones(2)}, tmp_path / "inner.safetensors")
    assert calls == [pace]
    assert torch.equal(load_file(tmp_path / "plain.safetensors")["x"], torch.ones(2))


def test_flush_writes_the_rest_at_full_speed(tmp_path, monkeypatch):
    monkeypatch.setattr(tensor_files, "CHUNK_BYTES", 1 << 20)
    writer = BackgroundWriter(mib_per_s=0.5)  # 8 MiB would take 16 s at this pace
    tensors = {"x": torch.arange(8 << 20, dtype=torch.uint8)}
    try:
        writer.submit(lambda: save_tensors(tensors, tmp_path / "w.safetensors"))
        time.sleep(0.2)
        path = tmp_path / "w.safetensors"
        assert not path.exists() or path.stat().st_size != 8 << 20  # still pacing (or not started yet)
        start = time.perf_counter()
        writer.flush()
        assert time.perf_counter() - start < 8  # far below the paced 16 s
    finally:
        writer.close()
    assert torch.equal(load_file(tmp_path / "w.safetensors")["x"], tensors["x"])
    assert not writer._pace.hurry.is_set()  # the next writes are paced again


def test_a_failed_paced_write_is_raised_by_flush(tmp_path):
    writer = BackgroundWriter(mib_per_s=1024)
    writer.submit(lambda: save_tensors({"x": torch.ones(2)}, tmp_path / "missing" / "w.safetensors"))
    with pytest.raises(FileNotFoundError):
        writer.flush()
    writer.close()


def test_every_rank_writes_its_share_of_a_step_s_records_and_rank_0_joins_them(tmp_path):
    """Three ranks (threads here, each its own writer) encode their contiguous shares of the same 10 records; rank 0
    publishes the file equal to one process's write, the shares' folder empty; a share that never comes is an
    error naming it."""
    from rlx.formats.records import ScoreRecord, write_records
    from rlx.ppo.writer import write_jsonl_shared

    records = [ScoreRecord(id=f"p{i // 2}/{i % 2}", prompt_id=f"p{i // 2}", reward=i / 3, rewards={}, advantage=-i,
                           response_length=i) for i in range(10)]  # fmt: skip
    write_records(tmp_path / "one.jsonl", records)
    parts = tmp_path / ".parts-x"
    ranks = [
        threading.Thread(target=write_jsonl_shared, args=(tmp_path / "scores.jsonl", records, r, 3, parts))
        for r in (0, 2, 1)  # rank 0 first: it waits for the others' shares
    ]
    for t in ranks:
        t.start()
        time.sleep(0.05)
    for t in ranks:
        t.join()
    assert (tmp_path / "scores.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    assert list(parts.iterdir()) == []
    with pytest.raises(RuntimeError, match=r"scores.jsonl.00001: another rank's share"):
        write_jsonl_shared(tmp_path / "scores.jsonl", records, 0, 2, parts, wait_s=0.1)
    assert (tmp_path / "scores.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()  # the old file stays


def test_the_records_writer_hands_the_interpreter_over_after_every_record(tmp_path, monkeypatch):
    """JSON encoding holds the interpreter: the writer thread yields it (a zero sleep) after each record, so the
    step's thread never waits a whole switch interval for it (bench/gil_handover.py times the difference)."""
    import rlx.ppo.writer as writer
    from rlx.formats.records import ScoreRecord

    records = [ScoreRecord(id=f"p{i}/0", prompt_id=f"p{i}", reward=0.0, rewards={}, advantage=0.0, response_length=1)
               for i in range(7)]  # fmt: skip
    sleeps = []
    monkeypatch.setattr(writer.time, "sleep", sleeps.append)
    writer.write_jsonl_shared(tmp_path / "s.jsonl", records, 1, 2, tmp_path / "parts")  # rank 1: records 4-6
    assert sleeps == [0, 0, 0] and len((tmp_path / "parts" / "s.jsonl.00001").read_text().splitlines()) == 3
