"""The coordinator of a run: its DHT's first node, the signed spec, admission, checkpoints, dashboard.

- coordinator: the run loop (publish the spec, look at the swarm, report, checkpoint);
- custody: checkpoints taken in a thread and offered to joiners, handovers, trained records, the books;
- authority, admission_files: who is admitted (credentials, invites, revocations);
- checkpoint, checkpointer, archive: checkpoints on disk (safetensors + JSON), pulling them from
  servers, and serving one to joiners on `--resume`;
- timeline, dashboard: the run's recent past and the web dashboard.

May import every lower package, peer.server included (the archive serves like a stage server).
"""
