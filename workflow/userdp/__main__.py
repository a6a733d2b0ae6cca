"""`python -m userdp ...`: see userdp.cli."""

import sys

from .cli import main

sys.exit(main())
