"""The model and the torch work on it, with no networking: what a stage or an expert computes.

- llama: the Llama-style model and its split into pipeline stages;
- moe, tp: mixture-of-experts layers, tensor parallelism (Megatron-style shards, the rank group);
- optim: the optimizer and learning-rate schedule;
- part, part_state: what every trainable part shares (accumulator, optimizer step, DiLoCo's outer
  step) and its state (snapshot, check, load, shards); fingerprint: comparing replicas' parameters;
- runtime, expert: the torch side of a stage server and of an expert host;
- tp_runtime, rank: a stage split over the tensor-parallel ranks of one peer.

May import protocols, dht, peer.process and peer.config.
"""
