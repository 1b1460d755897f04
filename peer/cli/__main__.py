"""`python -m peer.cli`: the `peer` command (peer.cli.main)."""

import sys

from peer.cli.main import main

sys.exit(main())
