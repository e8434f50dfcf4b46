"""``python -m flexhstu``: the same as the ``flexhstu`` command."""

import sys

from .cli.main import main

sys.exit(main())
