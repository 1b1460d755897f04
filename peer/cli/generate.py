"""`peer generate`: sample text from a checkpoint with the plain PyTorch model, no swarm needed.

The model reads bytes (vocab 256), so a prompt is its UTF-8 bytes and the continuation is decoded
leniently. Sampling: the last token's logits over `temperature`, the `top_k` largest kept.
"""

from __future__ import annotations

from pathlib import Path

import torch

from peer.config import RunSpec
from peer.coordinator import checkpoint
from peer.model.llama import StageModel


def load_model(source: str | Path) -> StageModel:
    """The whole model from a checkpoint directory (or a directory of them) or a `peer export` file."""
    source = Path(source)
    if source.is_file():
        return checkpoint.load_exported(source)
    spec, weights = checkpoint.model_weights(source)
    model = StageModel(RunSpec.from_dict(spec))
    model.load_state_dict(weights)
    return model


@torch.no_grad()
def sample(
    model: StageModel, prompt: bytes, tokens: int, temperature: float = 0.8, top_k: int = 40, seed: int = 0
) -> bytes:
    """`tokens` bytes that follow `prompt`, sampled from `model`."""
    if not prompt:
        prompt = b"\n"
    vocab = model.cfg.vocab_size
    if max(prompt) >= vocab:
        raise ValueError(f"the prompt holds bytes beyond the model's vocabulary of {vocab}")
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([list(prompt)], dtype=torch.long)
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
    return bytes(out)
