"""`peer generate`: sample text from a checkpoint or an exported model, with the plain model, no swarm.

A checkpoint's model reads bytes (vocab 256): the prompt is its UTF-8 bytes and the continuation
is decoded leniently. An exported directory carries its tokenizer (tokenizer.json, read with
`tokenizers`). Sampling: the last token's logits over `temperature`, the `top_k` largest kept.
"""

from __future__ import annotations

from pathlib import Path

import torch

from peer.config import RunSpec
from peer.coordinator import checkpoint
from peer.coordinator.export import load_directory
from peer.model.llama import StageModel


def load_model(source: str | Path) -> StageModel:
    """The whole model from a checkpoint directory (or a directory of them) or a `peer export` directory."""
    source = Path(source)
    if (source / "config.json").is_file():
        return load_directory(source)
    if source.is_file():
        raise checkpoint.CheckpointError(
            f"{source}: a file; give a checkpoint directory or a directory `peer export` wrote (with config.json)"
        )
    spec, weights = checkpoint.model_weights(source)
    model = StageModel(RunSpec.from_dict(spec))
    model.load_state_dict(weights)
    return model


class Codec:
    """Text to token ids and back: the directory's tokenizer.json, else bytes."""

    def __init__(self, source: str | Path):
        file = Path(source) / "tokenizer.json"
        self.tokenizer = None
        if file.is_file():
            from tokenizers import Tokenizer  # lazy: only exported directories carry one

            self.tokenizer = Tokenizer.from_file(str(file))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids if self.tokenizer else list(text.encode())

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer:
            return self.tokenizer.decode(ids)
        return bytes(ids).decode("utf-8", errors="replace")


@torch.no_grad()
def sample(
    model: StageModel, prompt: list[int], tokens: int, temperature: float = 0.8, top_k: int = 40, seed: int = 0
) -> list[int]:
    """`tokens` token ids that follow `prompt` (ids), sampled from `model`."""
    if not prompt:
        prompt = [ord("\n")]
    vocab = model.cfg.vocab_size
    if max(prompt) >= vocab:
        raise ValueError(f"the prompt holds tokens beyond the model's vocabulary of {vocab}")
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long)
    out = []
    for _ in range(tokens):
        logits = model(ids[:, -model.cfg.max_seq_len :])[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < vocab:
                cutoff = logits.topk(top_k).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            nxt = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out
