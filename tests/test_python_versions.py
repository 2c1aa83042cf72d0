"""The agent must run on Python 3.10 (JetPack 6 on the Jetson boards) as well as 3.11+.

No 3.10 interpreter is at hand here, so the check is static: vermin finds the oldest Python
each construct, module and library member needs, and none may need more than 3.10. Names
that only exist on 3.11 come from `agent/local/compat.py`, whose 3.11 branch is marked for vermin.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agent.local.compat import tomllib

REPO = Path(__file__).resolve().parents[1]
OLDEST = "3.10"
VERMIN = str(Path(sys.executable).with_name("vermin"))  # the test extra's command, in this environment


def test_the_code_needs_no_python_newer_than_3_10():
    result = subprocess.run(
        [VERMIN, "--no-tips", "--eval-annotations", "--violations",
         "--backport", "asyncio", "--backport", "typing", f"-t={OLDEST}-", "agent", "shards"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Minimum required versions: {OLDEST}" in result.stdout, result.stdout


def test_vermin_would_catch_a_3_11_only_name(tmp_path):
    """The check above can fail: the same command on a file using asyncio.timeout does."""
    (tmp_path / "new.py").write_text("import asyncio\n\nasync def f():\n    async with asyncio.timeout(1):\n        pass\n")
    result = subprocess.run([VERMIN, "--no-tips", "--violations", f"-t={OLDEST}-",
                             str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "3.11" in result.stdout


def test_the_package_declares_3_10_and_its_backports():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == f">={OLDEST}"
    backports = {d.split(">")[0].split(";")[0].strip() for d in project["dependencies"] if "python_version < '3.11'" in d}
    assert backports == {"async-timeout", "taskgroup", "tomli"}
