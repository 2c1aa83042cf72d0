"""llama.cpp as it comes, else with its extra buffer types off.

llama.cpp repacks the weights at load into the layouts of its extra buffer types (AMX tiles,
interleaved SIMD blocks). On some CPUs llama-cpp-python 0.3.x dies of it (a segmentation
fault, e.g. on an AMX-capable virtual machine); there the benchmarks measure llama.cpp again
with those buffer types off (its weights used as stored, memory-mapped) and say so.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping

PLAIN_ENV = "NCM_BENCH_LLAMA_PLAIN"  # "1": the llama.cpp worker loads without extra buffer types
PLAIN_NOTE = "extra buffer types off: its repacked weights crash on this CPU"


def crashed(returncode: int | None) -> bool:
    """A worker that died of a segmentation fault (the extra buffer types' crash)."""
    return returncode == -signal.SIGSEGV


def plain_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the worker told to load plain."""
    return {**(os.environ if env is None else env), PLAIN_ENV: "1"}


def apply() -> bool:
    """In a llama.cpp worker, before it loads a model: with :data:`PLAIN_ENV` set, models load
    without extra buffer types. True when it is set."""
    if os.environ.get(PLAIN_ENV) != "1":
        return False
    import llama_cpp.llama_cpp as api

    defaults = api.llama_model_default_params

    def plain_params():  # noqa: ANN202 - a ctypes structure
        params = defaults()
        params.use_extra_bufts = False
        return params

    api.llama_model_default_params = plain_params
    return True
