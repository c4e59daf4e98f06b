"""`python -m foundry` is `foundry`."""

import sys

from foundry.cli import main

sys.exit(main())
