"""A GGUF file's metadata is parsed once a process, and faster (rlx.models.loading.gguf_parsed_once): gguf's reader
over a plain array view of the map gives the same fields and tensors as over numpy's memmap, and transformers'
metadata-only loads share one conversion, each caller with its own copy."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


def _write_small_gguf(path):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_string("general.name", "small")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    writer.add_array("tokenizer.ggml.token_type", [1] * 300)
    writer.add_tensor("token_embd.weight", np.arange(48, dtype=np.float32).reshape(6, 8))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_array_view_parse_equals_gguf_s_own(tmp_path):
    from rlx.models.loading import _parse_from_array

    path = _write_small_gguf(tmp_path / "m.gguf")
    own, fast = gguf.GGUFReader(str(path)), _parse_from_array(gguf.GGUFReader, str(path))
    assert list(own.fields) == list(fast.fields) and len(own.fields) > 8
    for name, field in own.fields.items():
        other = fast.fields[name]
        assert field.types == other.types and field.data == other.data, name
        assert all(np.array_equal(a, b) for a, b in zip(field.parts, other.parts, strict=True)), name
    assert [t.name for t in own.tensors] == [t.name for t in fast.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(own.tensors, fast.tensors))
    assert type(fast.data) is np.ndarray and type(own.data) is np.memmap
    assert gguf.gguf_reader.np is np  # the module's numpy is back


def test_metadata_only_loads_are_converted_once_and_each_caller_gets_a_copy(tmp_path, monkeypatch):
    import transformers.configuration_utils as configuration_utils
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    import transformers.models.auto.tokenization_auto as tokenization_auto

    from rlx.models.loading import gguf_parsed_once, resolve_source

    path = _write_small_gguf(tmp_path / "m.gguf")
    calls = []

    def counted(p, return_tensors=False, model_to_load=None, **kwargs):
        calls.append(return_tensors)
        return {"config": {"model_type": "llama"}, "tokenizer": {"tokens": ["a", "b"]}}

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counted)
    with gguf_parsed_once(resolve_source(path)):
        first = configuration_utils.load_gguf_checkpoint(str(path), return_tensors=False)
        first["config"]["model_type"] = "changed by its caller"
        second = tokenization_auto.load_gguf_checkpoint(str(path))
        with_tensors = gguf_utils.load_gguf_checkpoint(str(path), return_tensors=True)
    assert calls == [False, True]  # one metadata conversion; a load with tensors is never shared
    assert second["config"]["model_type"] == "llama" and with_tensors["tokenizer"]["tokens"] == ["a", "b"]
    assert configuration_utils.load_gguf_checkpoint is not counted  # transformers' own functions are back
    assert gguf_utils.load_gguf_checkpoint is counted
