"""DHT side of Swarmtrain: key formats, typed records, peer identity, signed-record validation.

No torch here. `dht.node` is the one module that imports `hivemind.DHT`.
"""
