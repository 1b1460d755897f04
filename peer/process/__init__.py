"""Processes and their lifetimes: nothing a peer starts outlives it.

- lifetime: the reaper a long-running command starts first, `tied_to_me` for children, exit deadlines;
- reaper: the small process that ends what a peer started once the peer is gone;
- forkserver: `peer` commands forked from a template that has done the heavy imports (tests use it).

Imports nothing of peer outside this package (the fork server runs the CLI by name).
"""
