"""`python -m rlt_pd_coordinator serve ...` (the same as `rlt pd serve ...`)."""

import sys

from rlt_pd_coordinator.cli import main

sys.exit(main())
