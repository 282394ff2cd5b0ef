"""``python -m stalwart``: the same as the ``stalwart`` command."""

import sys

from stalwart.cli.main import main

sys.exit(main())
