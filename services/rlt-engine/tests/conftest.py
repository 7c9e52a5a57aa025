"""rlt-engine's test-support modules (pytest runs in importlib mode): serving_harness,
in_flight_failures; and the server fixtures serving_harness defines (checkpoint, http, client)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from serving_harness import checkpoint, client, http  # noqa: E402, F401  (fixtures)
