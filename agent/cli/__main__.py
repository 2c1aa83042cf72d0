"""``python -m agent.cli``: the ``ncm`` command without the entry point's environment."""

import sys

from agent.cli.main import main

sys.exit(main())
