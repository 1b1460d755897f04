"""A peer that serves a part of the model: stage servers, expert hosts, and their replicas' protocol.

- stage: the stage server (gRPC server, backward that may step, moving to another stage);
- servicer, expert_service: gRPC handlers of the stage and expert services;
- replica (with replica_step, replica_round, replica_state, replica_handover): one replica of a part
  and its step protocol with the other replicas: when to step, the averaging round, state transfer,
  the last server's handover as it leaves;
- averaging: a round among the replicas of one part (error feedback, the plausibility check), through
  allreduce (the butterfly all-reduce over our gRPC path, in this process), owned_slice (the slice a member
  reduces), slicing (slices, pieces, the flat view) and piece_codec (the averaging codecs on pieces);
- expert_host, batcher: hosting experts, with dynamic batching;
- dispatch: a stage's calls to the expert hosts of its MoE layers.

May import every lower package: protocols, dht, peer.process, config, net, model, data, swarm.
"""
