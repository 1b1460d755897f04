"""Run specs the security tests share (tests/test_security.py, tests/test_attacks.py)."""

from __future__ import annotations

SMALL = {
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "max_seq_len": 16},
    "stages": {"num_stages": 2},
    "training": {"micro_batch_size": 4, "seq_len": 16, "target_batch_size": 8, "total_steps": 1000},
    "averaging": {"averaging_timeout": 8.0},
}
