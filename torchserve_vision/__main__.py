"""`python -m torchserve_vision` is the `torchserve-vision` command."""

import sys

from torchserve_vision.cli import main

sys.exit(main())
