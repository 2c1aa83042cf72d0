"""The process environment the runtime runs best in.

Two settings only work when they are in the environment before the interpreter starts:

- ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``: glibc's malloc asks for transparent huge pages
  on what it maps. onnxruntime keeps the repacked weights in malloc'd memory, and where the
  kernel gives huge pages only on request (``madvise``, Debian's default) they sit in 4 KiB
  pages: a model's load then takes a page fault per 4 KiB and every decode step misses the TLB
  across hundreds of MB. Only where the kernel's mode is ``madvise``: ``always`` gives them
  anyway and ``never`` gives none.
- ``OPENBLAS_NUM_THREADS=1``: numpy's OpenBLAS starts a thread per core at import that spins
  while it waits for work, on the cores the model is loading and computing on; ncm does no
  matrix product in numpy that threads would speed up.

The ``ncm`` command's entry point (:func:`agent.cli.launch.main`) adds what is missing and starts
the command again in the same process (``exec``: same pid, for the service manager) before
anything heavy is imported. What the
user set wins: a ``GLIBC_TUNABLES`` that names ``glibc.malloc.hugetlb`` (``=0`` turns huge
pages off) or any ``OPENBLAS_NUM_THREADS`` is kept. Processes ncm spawns itself (the demo's
agents) get :func:`runtime_env` directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb"


def thp_mode(text: str) -> str | None:
    """The selected mode in the kernel's ``transparent_hugepage/enabled`` ("always [madvise]
    never" -> "madvise"); None when there is none."""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def read_thp_mode(path: Path = THP_MODE_FILE) -> str | None:
    try:
        return thp_mode(path.read_text(encoding="ascii"))
    except (OSError, UnicodeDecodeError):  # not Linux, or no transparent huge pages
        return None


def runtime_env(environ: Mapping[str, str], thp: str | None) -> dict[str, str]:
    """``environ`` with the runtime's settings added where the user set none (``thp``: the
    kernel's huge page mode, :func:`read_thp_mode`)."""
    env = dict(environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    tunables = env.get("GLIBC_TUNABLES", "")
    if thp == "madvise" and HUGEPAGE_TUNABLE not in tunables:
        env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, f"{HUGEPAGE_TUNABLE}=1") if t)
    return env

