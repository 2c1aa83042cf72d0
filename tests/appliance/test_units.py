"""The systemd files: `systemd-analyze verify` prints nothing, the agent unit scores <= 2.0."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "systemd"
UNITS = sorted(p.name for p in SYSTEMD.glob("*.service"))
HOST_UNITS = Path("/usr/lib/systemd/system")


def _analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.fail("systemd-analyze is missing: run image/ci-setup (apt-get install systemd)")
    return tool


def _unit(name: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    # Repeated keys (DeviceAllow=, SystemCallFilter=) are legal in units: keep the last.
    parser.read_string((SYSTEMD / name).read_text())
    return parser


@pytest.fixture(scope="module")
def unit_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root directory as an image has it: the host's units, ours, and /opt/ncm/bin/ncm.

    `systemd-analyze verify` checks that ExecStart= programs exist; here /opt/ncm/bin/ncm
    is a wrapper running this checkout's CLI (the image test verifies the real install).
    """
    if not HOST_UNITS.is_dir():
        pytest.skip("this system has no systemd unit directory to verify against")
    root = tmp_path_factory.mktemp("unit-root")
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree(HOST_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    for unit in UNITS:
        shutil.copy(SYSTEMD / unit, root / "usr/lib/systemd/system" / unit)
    (root / "etc").mkdir()
    ncm = root / "opt/ncm/bin/ncm"
    ncm.parent.mkdir(parents=True)
    ncm.write_text(f"#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m agent.cli \"$@\"\n")
    ncm.chmod(0o755)
    return root


@pytest.mark.parametrize("unit", UNITS)
def test_verify_prints_nothing(unit: str, unit_root: Path) -> None:
    result = subprocess.run([_analyze(), "verify", "--man=no", f"--root={unit_root}", unit],
                            capture_output=True, text=True, timeout=120)
    # systemd-analyze verify exits 0 on warnings: its output is what counts.
    assert result.stdout + result.stderr == ""
    assert result.returncode == 0


def _exposure(unit_path: Path) -> tuple[float, str]:
    result = subprocess.run([_analyze(), "security", "--offline=true", "--no-pager", str(unit_path)],
                            capture_output=True, text=True, timeout=120, cwd=unit_path.parent)
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?) (\w+)", result.stdout)
    assert match, result.stdout + result.stderr
    return float(match.group(1)), match.group(2)


def test_agent_unit_security_score(tmp_path: Path) -> None:
    unit = tmp_path / "ncm-agent.service"
    shutil.copy(SYSTEMD / "ncm-agent.service", unit)
    score, verdict = _exposure(unit)
    assert score <= 2.0 and verdict == "OK", f"exposure {score} {verdict}"


def test_agent_unit_contract() -> None:
    unit = _unit("ncm-agent.service")
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert int(service["WatchdogSec"]) > 0
    assert service["Restart"] == "on-failure"
    assert service["User"] == "ncm"
    assert set(service["SupplementaryGroups"].split()) == {"video", "render"}
    assert service["StateDirectory"] == "ncm" and service["ConfigurationDirectory"] == "ncm"
    assert service["ProtectSystem"] == "strict"
    assert service["ProtectHome"] == "yes" and service["PrivateTmp"] == "yes"
    assert service["NoNewPrivileges"] == "yes"
    assert service["RestrictAddressFamilies"].split() == ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"]
    assert service["DevicePolicy"] == "closed"
    text = (SYSTEMD / "ncm-agent.service").read_text()
    allowed = re.findall(r"^DeviceAllow=(\S+) (\S+)$", text, flags=re.M)
    names = {name for name, _ in allowed}
    for needed in ("char-drm", "char-accel", "char-nvidia-frontend", "char-nvidia-uvm", "/dev/nvmap", "char-nvhost*"):
        assert needed in names
    assert all(mode == "rw" for _, mode in allowed)
    assert "--config /etc/ncm/agent.toml" in service["ExecStart"]
    environment = " ".join(re.findall(r"^Environment=(.*)$", text, flags=re.M)).split()
    assert "NCM_HOME=/var/lib/ncm" in environment and "PYTHONFAULTHANDLER=1" in environment


def test_firstboot_unit_runs_until_it_succeeds() -> None:
    unit = _unit("ncm-firstboot.service")
    assert unit["Unit"]["ConditionPathExists"] == "!/var/lib/ncm/node-id"
    assert unit["Service"]["Type"] == "oneshot"
    assert "ncm firstboot" in unit["Service"]["ExecStart"].replace("/opt/ncm/bin/", "")
    agent = _unit("ncm-agent.service")["Unit"]
    assert "ncm-firstboot.service" in agent["After"] and "ncm-firstboot.service" in agent["Requires"]


def test_sysusers_file(tmp_path: Path) -> None:
    tool = shutil.which("systemd-sysusers")
    if tool is None:
        pytest.fail("systemd-sysusers is missing: run image/ci-setup")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for name in ("passwd", "group", "shadow", "gshadow"):
        (root / "etc" / name).write_text("")
    result = subprocess.run([tool, f"--root={root}", str(SYSTEMD / "sysusers.d/ncm.conf")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    passwd = (root / "etc/passwd").read_text()
    group = (root / "etc/group").read_text()
    assert re.search(r"^ncm:x:\d+:\d+:ncm agent:/var/lib/ncm:/usr/sbin/nologin$", passwd, flags=re.M)
    assert re.search(r"^video:x:\d+:ncm$", group, flags=re.M)
    assert re.search(r"^render:x:\d+:ncm$", group, flags=re.M)


def test_sysctl_dropin_names_real_keys() -> None:
    lines = [line.strip() for line in (SYSTEMD / "sysctl.d/60-ncm.conf").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith(("#", ";"))]
    assert lines, "the sysctl drop-in sets nothing"
    for line in lines:
        key, _, value = (part.strip() for part in line.partition("="))
        assert Path("/proc/sys", *key.split(".")).exists() or not Path("/proc/sys/net").exists(), key
        assert int(value) >= 20
    assert any(line.startswith("net.ipv4.igmp_max_memberships") for line in lines)


def test_unit_files_are_plain() -> None:
    for path in SYSTEMD.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert text.endswith("\n") and "\t" not in text and "\r" not in text, path
            assert os.access(path, os.X_OK) is False, f"{path} should not be executable"
