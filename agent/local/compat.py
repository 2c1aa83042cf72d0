"""Python 3.10 support (JetPack 6, the Jetson boards' system, ships it).

The 3.11 names ncm uses come from their standard backports on 3.10. Code catches
``asyncio.TimeoutError``: on 3.11+ it is the built-in ``TimeoutError``; on 3.10 it is what
asyncio timeouts and aiohttp raise. `tests/test_python_versions.py` checks statically that
nothing else needs a newer Python.
"""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib  # novermin
    from asyncio import TaskGroup, timeout  # novermin
else:  # pragma: no cover - runs on Python 3.10 only
    import tomli as tomllib
    from async_timeout import timeout
    from taskgroup import TaskGroup

__all__ = ["TaskGroup", "timeout", "tomllib"]
