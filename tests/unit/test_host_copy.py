"""Snapshot host buffers carved out of pinned chunks of one power-of-two size (rlx/utils/host_copy.py): torch's pinned
allocator rounds each allocation up to a power of two and pins all of it (a 7B rank's 22.8 GB of shards took 43.3 GiB).
On the CPU the chunks are plain tensors (pinning needs CUDA); the GPU test in test_config.py pins them."""

from __future__ import annotations

import torch

from rlx.utils import host_copy


def test_buffers_are_packed_views_of_few_chunks_that_do_not_overlap(monkeypatch):
    made = []

    def chunk(nbytes: int) -> torch.Tensor:
        made.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(host_copy, "_new_chunk", chunk)
    monkeypatch.setattr(host_copy, "CHUNK_MIN_BYTES", 1 << 12)
    shapes = {"embed": ((300, 8), torch.float32), "w1": ((17, 5), torch.bfloat16), "w2": ((100,), torch.float32),
              "step": ((), torch.float32), "empty": ((0, 3), torch.float32), "mask": ((33,), torch.bool)}  # fmt: skip
    shapes = {k: (torch.Size(s), d) for k, (s, d) in shapes.items()}
    made_bytes = host_copy._ensure("t", shapes)
    assert made_bytes == 300 * 8 * 4 + 17 * 5 * 2 + 400 + 4 + 0 + 33
    buffers = {k: host_copy._BUFFERS[f"t/{k}"] for k in shapes}
    assert all(b.shape == shapes[k][0] and b.dtype == shapes[k][1] and b.is_contiguous() for k, b in buffers.items())
    # one power-of-two chunk size, at least the largest tensor (9,600 bytes: 16 KiB); far below one chunk per tensor
    assert made == [16384] and sum(made) < 2 * made_bytes
    for key, buffer in buffers.items():  # each written apart from the others: no two views overlap
        buffer.copy_(torch.full(buffer.shape, 3).to(buffer.dtype) if buffer.numel() else buffer)
        for other, value in buffers.items():
            if other != key and value.numel():
                value.zero_()
        assert buffer.numel() == 0 or bool((buffer != 0).all()), key
    assert host_copy._ensure("t", shapes) == 0 and all(host_copy._BUFFERS[f"t/{k}"] is buffers[k] for k in shapes)
    grown = {**shapes, "w2": (torch.Size([200]), torch.float32)}  # another shape: that key alone is made again
    assert host_copy._ensure("t", grown) == 800 and host_copy._BUFFERS["t/w2"].shape == (200,)
    assert host_copy._BUFFERS["t/embed"] is buffers["embed"]
    for key in grown:
        host_copy._BUFFERS.pop(f"t/{key}")


def test_a_tensor_larger_than_the_smallest_chunk_sets_the_chunk_size(monkeypatch):
    made = []
    monkeypatch.setattr(host_copy, "_new_chunk", lambda n: made.append(n) or torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(host_copy, "CHUNK_MIN_BYTES", 1 << 10)
    carved = host_copy._carve({"big": (torch.Size([3000]), torch.float32), "small": (torch.Size([10]), torch.int64)})
    assert made == [16384]  # 12,000 bytes rounded up to a power of two; the small one fits beside it
    assert carved["big"].untyped_storage().data_ptr() == carved["small"].untyped_storage().data_ptr()
    assert host_copy._carve({}) == {} and made == [16384]


def test_the_writers_take_carved_views_as_whole_tensors(monkeypatch, tmp_path):
    """What a checkpoint writes from the carved buffers: safetensors (its own save_file and rlx's paced writer) and
    DCP's threaded FileSystemWriter read back each view's values alone, not its chunk (views of one storage that do
    not overlap are not 'shared tensors'; DCP copies a view out before it serializes it)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from rlx.utils.tensor_files import save_tensors, write_safetensors

    monkeypatch.setattr(host_copy, "_new_chunk", lambda n: torch.zeros(n, dtype=torch.uint8))
    shapes = {"a": (torch.Size([64, 8]), torch.float32), "b": (torch.Size([5]), torch.bfloat16),
              "c": (torch.Size([3, 3]), torch.float32)}  # fmt: skip
    views = host_copy._carve(shapes)
    assert len({v.untyped_storage().data_ptr() for v in views.values()}) == 1  # one chunk
    for i, view in enumerate(views.values()):
        view.copy_(torch.randn(view.shape, generator=torch.Generator().manual_seed(i)).to(view.dtype))
    expected = {k: v.clone() for k, v in views.items()}
    save_tensors(views, tmp_path / "a.safetensors")
    write_safetensors(tmp_path / "b.safetensors", views)
    for name in ("a", "b"):
        read = load_file(tmp_path / f"{name}.safetensors")
        assert read.keys() == expected.keys() and all(read[k].equal(expected[k]) for k in expected)
    dcp.save(dict(views), storage_writer=dcp.FileSystemWriter(tmp_path / "dcp", thread_count=2), no_dist=True)
    loaded = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(loaded[k].equal(expected[k]) for k in expected)
    sizes = sum(p.stat().st_size for p in (tmp_path / "dcp").glob("*.distcp"))
    assert sizes < host_copy.CHUNK_MIN_BYTES  # the views' bytes, not their 256 MiB chunk


def test_exact_storage_aliases_a_view_so_dcp_writes_it_without_a_copy(monkeypatch, tmp_path):
    """`exact_storage`: the same memory over a storage of exactly the tensor's bytes (DCP's writer copies out every
    tensor whose storage is larger: `untyped_storage().size() != nbytes`), read back equal; a tensor already whole is
    returned as it is."""
    import torch.distributed.checkpoint as dcp

    monkeypatch.setattr(host_copy, "_new_chunk", lambda n: torch.zeros(n, dtype=torch.uint8))
    views = host_copy._carve({"a": (torch.Size([64, 8]), torch.float32), "b": (torch.Size([5]), torch.bfloat16)})
    aliases = {k: host_copy.exact_storage(v) for k, v in views.items()}
    for key, view in views.items():
        alias = aliases[key]
        assert view.untyped_storage().size() > view.nbytes and alias.untyped_storage().size() == alias.nbytes
        assert alias.data_ptr() == view.data_ptr() and alias.shape == view.shape and alias.dtype == view.dtype
        view.copy_(torch.arange(view.numel()).view(view.shape).to(view.dtype))  # written through the view ...
        assert alias.equal(view)  # ... read through the alias
    whole = torch.ones(3)
    assert host_copy.exact_storage(whole) is whole
    dcp.save(dict(aliases), storage_writer=dcp.FileSystemWriter(tmp_path / "dcp", thread_count=2), no_dist=True)
    loaded = {k: torch.zeros_like(v) for k, v in views.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(loaded[k].equal(views[k]) for k in views)
