"""Two replicas' answers to one request compared: spot checks (peer.trainer.spotcheck) and the coordinator's
own probe of a reported server (peer.coordinator.referee) ask the same of several replicas at one step.

An answer is a forward's outputs, or a last stage's loss then the gradients it sends back. Two agree when
each tensor's largest difference is within a tolerance of its largest magnitude, plus what the activation
codec may lose on each side (`CODEC_ERROR`).
"""

from __future__ import annotations

import torch

from protocols import codec, stage_pb2, tensor_pb2

# the largest error of each activation codec, as a fraction of a tensor's largest magnitude (one side)
CODEC_ERROR = {tensor_pb2.NONE: 0.0, tensor_pb2.FP16: 2**-11, tensor_pb2.BF16: 2**-8, tensor_pb2.INT8: 1 / 254}


def agree(a: torch.Tensor | list, b: torch.Tensor | list, tolerance: float) -> bool:
    """Whether two answers agree: each tensor (a forward's outputs; a last stage's loss, then its gradients)
    within `tolerance` of its largest magnitude."""
    if isinstance(a, list) or isinstance(b, list):
        return len(a) == len(b) and all(agree(x, y, tolerance) for x, y in zip(a, b, strict=True))
    if a.shape != b.shape:
        return False
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-6) if a.numel() else 1e-6
    return a.numel() == 0 or (a - b).abs().max().item() <= tolerance * scale


def answer_of(response, returned: dict, limit: int) -> torch.Tensor | list[torch.Tensor]:
    """What is compared of an answer: a forward's outputs; a last stage's loss and the gradients it sends back
    (`limit`: the most elements a decoded tensor may have)."""
    if isinstance(response, stage_pb2.BackwardResponse):
        if not response.HasField("grad_inputs"):  # a one-stage run: the loss alone
            return [torch.tensor([response.loss])]
        grads = codec.decode(response.grad_inputs, limit, returned.get("grad_inputs"))
        return [torch.tensor([response.loss]), grads.float()]
    return codec.decode(response.outputs, limit, returned.get("outputs"))
