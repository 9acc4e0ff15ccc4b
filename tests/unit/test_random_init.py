"""Random init from a config (rlx.models.random_init): per-module seeded draws, the same for any thread count,
every tensor initialised by the model's own `_init_weights`, the caller's random state untouched."""

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3Config

from rlx.models import random_init
from rlx.models.loading import init_random_model
from rlx.models.vision.families import FAMILIES
from rlx.models.vision.tiny import tiny_vision_config, tiny_vision_processor

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TEXT = {
    "qwen2": lambda: Qwen2Config(vocab_size=97, **SMALL),
    "llama_tied": lambda: LlamaConfig(vocab_size=97, tie_word_embeddings=True, pad_token_id=0, **SMALL),
    "qwen3": lambda: Qwen3Config(vocab_size=97, head_dim=8, **SMALL),
}


def _config(name: str):
    if name in TEXT:
        config = TEXT[name]()
        config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
        return config
    return tiny_vision_config(name, tiny_vision_processor(name).tokenizer)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", [*TEXT, *(f.name for f in FAMILIES.values())])
def test_same_model_for_any_thread_count_and_seeded(name, monkeypatch):
    config = _config(name)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = _state(init_random_model(config, seed=3))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    before = torch.random.get_rng_state()
    four = _state(init_random_model(config, seed=3))
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's random state is untouched
    other = _state(init_random_model(config, seed=4))
    assert one.keys() == four.keys()
    for key in one:
        assert torch.equal(one[key], four[key]), key
    drawn = [k for k, v in one.items() if v.dim() == 2 and v.numel() > 64 and v.std() > 0]
    assert drawn and all(not torch.equal(one[k], other[k]) for k in drawn)


@pytest.mark.parametrize("name", [*TEXT, "qwen2_vl"])
def test_every_tensor_initialised_like_transformers(name):
    """Each parameter is written by an init function (none left as uninitialised memory), with the statistics of
    transformers' own init (normal std initializer_range for matrices, ones for norms)."""
    config = _config(name)
    written: list[set[int]] = []
    real_run = random_init._run

    def spy(tasks, seed, threads):
        out = real_run(tasks, seed, threads)
        written.extend(out)
        return out

    random_init._run = spy
    try:
        model = init_random_model(config, seed=0)
    finally:
        random_init._run = real_run
    storages = set().union(*written)
    for key, param in model.named_parameters():
        assert param.untyped_storage().data_ptr() in storages, f"{key} was not initialised"
        assert torch.isfinite(param).all(), key
    reference = type(model)._from_config(config, dtype=torch.float32)
    expected = dict(reference.named_parameters())
    for key, param in model.named_parameters():
        if param.dim() == 2 and param.numel() >= 1024 and "embed" not in key:
            assert param.std().item() == pytest.approx(expected[key].std().item(), rel=0.25), key
        elif "norm" in key:
            assert torch.equal(param, expected[key]), key
    if getattr(config, "tie_word_embeddings", False):
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_modules_that_share_a_tensor_fall_back_to_order(monkeypatch):
    """Two modules writing one tensor (here: an untied lm_head forced to share the embedding's storage before the
    init) cannot run in parallel; the init falls back to transformers' order and stays deterministic."""
    config = _config("qwen2")
    config.tie_word_embeddings = False
    calls = []
    real_run = random_init._run

    def spy(tasks, seed, threads):
        calls.append(threads)
        return real_run(tasks, seed, threads)

    from transformers.initialization import no_init_weights

    def build():
        with no_init_weights():
            model = Qwen2ForCausalLM._from_config(config, dtype=torch.float32)
        model.lm_head.weight = model.model.embed_tokens.weight
        random_init.init_modules(model, seed=1, threads=4)
        return model.lm_head.weight.clone()

    monkeypatch.setattr(random_init, "_run", spy)
    first = build()
    assert calls == [4, 1]
    assert torch.equal(first, build())
