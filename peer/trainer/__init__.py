"""A peer that trains: micro-batches of its data through the stages, forward then backward.

- trainer: the loop (micro-batches in flight, until the run's last step);
- calls: each call on one live replica, rerouted and banned on failure;
- settling, ledger: receipts of backwards until their server steps them, replayed if it goes away;
- journal: the micro-batches not settled, on disk: a start after a kill finishes them once;
- reporting, progress: validation, loss and speed, progress, the trainer's DHT record;
- spotcheck: re-sending some forwards to a second replica and comparing;
- local: the plain single-process loop the swarm is measured against.

May import every lower package: protocols, dht, peer.process, config, net, model, data, swarm.
"""
