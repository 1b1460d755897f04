"""Swarmtrain's peer runtime, in packages by role. Lowest first; each may import only those before it
(tests/test_structure.py checks it, with no import cycles):

- peer.process: processes and their lifetimes (reaper, fork server);
- peer.config: the run spec and a peer's settings, as dataclasses from TOML;
- peer.net: gRPC channels and servers, TLS, relays, metrics;
- peer.model: the model and its torch work (stages, experts, tensor parallelism, optimizer, state);
- peer.data: training and validation data;
- peer.swarm: the swarm as the DHT shows it (spec, stage choice, routing, status);
- peer.server: stage servers, expert hosts, and the replicas' step and averaging protocol;
- peer.trainer: trainers: calls with rerouting, receipts, reporting;
- peer.coordinator: the run's coordinator: admission, checkpoints, dashboard;
- peer.cli: the `peer` command.

Below them all: protocols (the wire contract) and dht (records, keys, identity).
"""
