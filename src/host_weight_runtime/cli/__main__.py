"""`python -m host_weight_runtime.cli` runs `hwr`."""

import sys

from . import main

# Guarded so that importing every module of the package (as tests/test_architecture.py does) runs nothing.
if __name__ == "__main__":
    sys.exit(main())
