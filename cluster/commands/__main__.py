"""`python -m dspark_serve.cluster.commands ARGS` runs `dspark-serve ARGS`."""

import sys

from .cli import main

sys.exit(main())
