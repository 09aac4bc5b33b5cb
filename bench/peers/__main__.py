"""`python -m bench.peers`: see bench/peers/harness.py."""
import sys

from bench.peers.harness import main

sys.exit(main())
