"""The swarm as the DHT shows it: the signed run spec, which stage needs a server, who serves what.

- discovery: finding a run (the coordinator's signed spec) and the stage a new server should take;
- balance: which stage a server should serve so that the slowest stage goes fastest;
- router: the trainer's (and dispatcher's) view of the servers: speed, bans, who is gone;
- status: `peer status`'s table of stages, servers and trainers;
- books: the run's books, samples completed against what each stage accounts (the coordinator keeps them).

May import protocols, dht, peer.process, peer.config, peer.net and peer.model.
"""
