"""``python -m shards.cli``: the model commands alone."""

import sys

from shards.cli.commands import main

sys.exit(main())
