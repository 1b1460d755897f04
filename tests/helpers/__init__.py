"""The tests' fixture layer: a swarm of real peer processes (swarm), calls to them (calls), and what is left
behind (processes). Also helper programs the tests run: reaped.py, rogue.py."""
