"""Reward models: a Hugging Face `*ForSequenceClassification` model scored at the last response token.

The conversation is re-encoded with the reward model's own tokenizer (its chat template when it has
one, else prompt text + response text), so a reward model need not share the policy's tokenizer.
"""

from __future__ import annotations

import torch

from rlx.errors import UserError
from rlx.models.loading import ModelSource, load_tokenizer, quiet_transformers
from rlx.utils.device import autocast


class RewardModel:
    """A sequence-classification reward model held on `device`."""

    def __init__(self, source: ModelSource, config, device: torch.device, dtype: torch.dtype):
        """`config`: the source's transformers config, read by the caller (`resolve_model`)."""
        from transformers import AutoModelForSequenceClassification

        quiet_transformers()
        archs = getattr(config, "architectures", None) or []
        if not any(a.endswith("ForSequenceClassification") for a in archs):
            raise UserError(
                f"{source.path}: not a reward model (expected a *ForSequenceClassification config, "
                f"got {archs or 'no architectures'})"
            )
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(source.folder, dtype=torch.float32)
        except (OSError, ValueError, RuntimeError) as e:
            raise UserError(f"{source.path}: cannot load the reward model ({str(e).splitlines()[0]})") from None
        if not isinstance(getattr(self.model, "score", None), torch.nn.Module):
            raise UserError(f"{source.path}: reward model has no 'score' head (unsupported model family)")
        if self.model.config.num_labels != 1:
            raise UserError(f"{source.path}: reward model has {self.model.config.num_labels} labels, expected 1")
        self.model.to(device).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(source)
        self.device, self.dtype = device, dtype

    def encode(self, prompt: str | list[dict], response: str) -> list[int]:
        """Token ids of a prompt (text or chat messages) and its response, in this model's own format."""
        if getattr(self.tokenizer, "chat_template", None):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            messages = [*messages, {"role": "assistant", "content": response}]
            return list(self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        if isinstance(prompt, list):
            prompt = "\n".join(m["content"] for m in prompt)
        return list(self.tokenizer(prompt + response)["input_ids"])

    @torch.no_grad()
    def score(self, conversations: list[tuple[str | list[dict], str]], micro_batch_size: int) -> torch.Tensor:
        """The head's output at each (prompt, response)'s last token: [B] float32."""
        out = []
        for lo in range(0, len(conversations), micro_batch_size):
            encoded = [self.encode(*c) for c in conversations[lo : lo + micro_batch_size]]
            width = max(len(ids) for ids in encoded)
            ids = torch.zeros((len(encoded), width), dtype=torch.long)
            mask = torch.zeros((len(encoded), width), dtype=torch.long)
            for row, seq in enumerate(encoded):  # right padding: the last real token is at len - 1
                ids[row, : len(seq)] = torch.tensor(seq)
                mask[row, : len(seq)] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            backbone = getattr(self.model, self.model.base_model_prefix)
            with autocast(self.device, self.dtype):
                hidden = backbone(input_ids=ids, attention_mask=mask).last_hidden_state
                logits = self.model.score(hidden).float()[..., 0]  # [b, T]
            last = mask.sum(-1) - 1
            out.append(logits[torch.arange(len(encoded), device=self.device), last].cpu())
        return torch.cat(out)
