"""Known accelerators and their published INT8 TOPS, matched against board / CPU strings.

The numbers are vendors' figures for the NPU (or, on Jetson, the module's AI performance);
the configuration can override them (`npu_tops`).
"""

from __future__ import annotations

# (substring to look for, lower case; TOPS). More specific entries come first.
KNOWN_ACCELERATORS: tuple[tuple[str, float], ...] = (
    ("jetson agx orin 64gb", 275.0),
    ("jetson agx orin", 200.0),
    ("jetson orin nx 16gb", 100.0),
    ("jetson orin nx", 70.0),
    ("jetson orin nano 8gb", 40.0),
    ("jetson orin nano", 20.0),
    ("jetson agx xavier", 32.0),
    ("jetson xavier nx", 21.0),
    ("jetson nano", 0.5),
    ("rk3588", 6.0),
    ("rk3576", 6.0),
    ("rk3568", 0.8),
    ("rk3566", 0.8),
    ("intel(r) core(tm) ultra 7 2", 48.0),  # Lunar Lake / Arrow Lake-class Core Ultra 200
    ("intel(r) core(tm) ultra 5 2", 40.0),
    ("intel(r) core(tm) ultra", 11.0),  # Meteor Lake
    ("snapdragon x elite", 45.0),
    ("snapdragon x plus", 45.0),
    ("qcs6490", 12.0),
    ("qcs8550", 48.0),
    ("hailo-8l", 13.0),
    ("hailo-8", 26.0),
)


def npu_tops_for(descriptions: list[str]) -> tuple[float, str | None]:
    """The TOPS of the first known accelerator named in any description, and its name."""
    lowered = [text.lower().replace("\x00", " ") for text in descriptions]
    for needle, tops in KNOWN_ACCELERATORS:
        if any(needle in text for text in lowered):
            return tops, needle
    return 0.0, None
