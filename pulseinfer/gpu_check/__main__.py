"""`python -m pulseinfer.gpu_check`: the whole check, or one step of it in this process (--step NAME)."""

import sys

from pulseinfer.gpu_check.harness import main

sys.exit(main())
