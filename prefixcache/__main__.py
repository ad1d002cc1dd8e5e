"""``python -m prefixcache`` is the same as the ``prefixcache`` command."""

import sys

from prefixcache.entrypoints.cli import main

sys.exit(main())
