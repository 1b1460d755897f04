"""A bare hivemind DHT node, nothing of ours: hivemind's own `DHT` on loopback, bootstrapped from the addresses
given, printing its own address, then idle until it is killed. `rest.py` measures a swarm at rest beside them.

    python benchmarks/bare_dht.py [MULTIADDR ...]
"""

from __future__ import annotations

import sys
import threading

import hivemind


def main() -> None:
    dht = hivemind.DHT(initial_peers=sys.argv[1:], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    print("Bare DHT node at", " ".join(str(m) for m in dht.get_visible_maddrs()), flush=True)
    threading.Event().wait()  # idle until killed (benchmarks start it tied to themselves)


if __name__ == "__main__":
    main()
