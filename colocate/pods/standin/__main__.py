"""``python -m colocate.pods.standin``: the stand-in's CLI (server.main)."""

import sys

from .server import main

sys.exit(main())
