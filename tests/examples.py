"""How many examples the property tests try, by Hypothesis profile (``NCM_TEST_PROFILE``):

- ``thorough``: every example each test asks for. ``./dev test`` (the whole suite, as CI runs
  it) uses it.
- ``fast`` (the default): a fifth of them, at least 10, so that the fast tier
  (``pytest -m "not slow"``) stays the inner loop of a change. A property that fails only now
  and then is still found by the thorough run.

tests/conftest.py loads the profile before any test module is imported.
"""

from __future__ import annotations

import os

from hypothesis import settings

PROFILE = os.environ.get("NCM_TEST_PROFILE", "fast")
THOROUGH_EXAMPLES = 100  # Hypothesis' own default, for tests that do not ask for a number

settings.register_profile("thorough", max_examples=THOROUGH_EXAMPLES)
settings.register_profile("fast", max_examples=THOROUGH_EXAMPLES // 5)
if PROFILE not in ("thorough", "fast"):
    raise ValueError(f"NCM_TEST_PROFILE is {PROFILE!r}: use thorough or fast")
settings.load_profile(PROFILE)


def examples(count: int) -> int:
    """``count`` examples in the thorough profile, a fifth of them (at least 10) in the fast one."""
    return count if PROFILE == "thorough" else max(10, count // 5)
