"""The `peer` command: one module per command and role, on top of everything else.

- main: parse, start the reaper, run the command, one line per error (no torch, no hivemind: fast);
- parser, options: the command line, and a peer's settings from it;
- commands: one function per command; join and role_server, role_experts, role_relay, role_trainer:
  `peer join` in each of its roles; demo, generate: `peer demo`, `peer generate`.

The top layer: may import anything; nothing imports it (the fork server runs it by name).
"""
