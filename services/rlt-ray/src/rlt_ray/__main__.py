import sys

from rlt_ray.cli import main

sys.exit(main())
