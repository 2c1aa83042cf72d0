"""image/build: the vendor profiles' --dry-run against stub trees, and the scripts' syntax.

The Armbian and NVIDIA L4T downloads cannot be reached from CI, so these profiles are
checked against stub trees that have the same layout (the files each profile looks for):
the stubs exist only for these tests, and the dry run must leave them untouched.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "image" / "build"


def build(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(BUILD), *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)


def snapshot(tree: Path) -> dict[str, str]:
    return {str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(tree.rglob("*"))}


def stub_file(path: Path, text: str = "#!/bin/sh\necho 'stub tree: must not run' >&2\nexit 99\n") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


@pytest.mark.parametrize("script", ["build", "install-agent", "lib/common.sh", "profiles/debian-generic.sh",
                                    "profiles/rk3588.sh", "profiles/jetson.sh",
                                    "profiles/rk3588/customize-image.sh", "profiles/debian-generic/zz-ncm-esp",
                                    "ci-setup"])
def test_scripts_parse(script: str) -> None:
    path = REPO / "image" / script
    shell = "sh" if script.endswith("zz-ncm-esp") else "bash"
    result = subprocess.run([shell, "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_help_and_unknown_profile() -> None:
    assert build("--help").returncode == 0
    result = build("raspberry-pi")
    assert result.returncode != 0 and "unknown profile" in result.stderr
    for profile in ("debian-generic", "rk3588", "jetson"):
        result = build(profile, "--help")
        assert result.returncode == 0 and f"image/build {profile}" in result.stdout


def test_debian_generic_dry_run(tmp_path: Path) -> None:
    result = build("debian-generic", "--arch", "arm64", "--out", str(tmp_path / "out"),
                   "--work", str(tmp_path / "work"), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "mmdebstrap --variant=apt --architectures=arm64" in result.stdout
    assert "linux-image-arm64" in result.stdout
    assert "root-arm64 3G" in result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()
    assert build("debian-generic", "--arch", "riscv64", "--dry-run").returncode != 0


# ------------------------------------------------------------------------------- rk3588


@pytest.fixture
def armbian(tmp_path: Path) -> Path:
    """A stub of Armbian's build framework: compile.sh and an RK3588 board config."""
    tree = tmp_path / "armbian-build"
    stub_file(tree / "compile.sh")
    (tree / "config/boards").mkdir(parents=True)
    (tree / "config/boards/rock-5b.conf").write_text('BOARD_NAME="Rock 5B"\nBOARDFAMILY="rockchip-rk3588"\n')
    (tree / "config/boards/orangepi5.conf").write_text('BOARD_NAME="Orange Pi 5"\nBOARDFAMILY="rockchip-rk3588"\n')
    return tree


def test_rk3588_dry_run(armbian: Path, tmp_path: Path) -> None:
    before = snapshot(armbian)
    setup = tmp_path / "ncm-setup.txt"
    setup.write_text("cluster_name = kitchen\ncluster_key = a-long-enough-cluster-key\n")
    result = build("rk3588", "--armbian-dir", str(armbian), "--board", "orangepi5", "--setup", str(setup),
                   "--work", str(tmp_path / "work"), "--dry-run")
    assert result.returncode == 0, result.stderr
    log = result.stdout + result.stderr
    assert "./compile.sh ncm-rk3588" in result.stdout
    for line in ("BOARD=orangepi5", "BRANCH=vendor", "RELEASE=bookworm", "BOOTFS_TYPE=fat", "BUILD_MINIMAL=yes"):
        assert line in log
    assert "customize-image.sh" in log and "rknn-toolkit-lite2" in log
    assert "librknnrt.so" in log  # warns that the NPU runtime was not supplied
    assert "a-long-enough-cluster-key" not in log
    assert snapshot(armbian) == before, "the dry run changed the Armbian tree"
    assert not (tmp_path / "work").exists()


def test_rk3588_dry_run_with_the_rknn_converter(armbian: Path, tmp_path: Path) -> None:
    """--rknn-converter: rknn-toolkit2 (the version ./dev uses) for an environment of its own on
    the board, which customize-image.sh makes and names to the agent."""
    result = build("rk3588", "--armbian-dir", str(armbian), "--rknn-converter", "--work", str(tmp_path / "work"),
                   "--dry-run")
    assert result.returncode == 0, result.stderr
    log = result.stdout + result.stderr
    assert "RKNN converter (rknn-toolkit2==" in log and "/opt/ncm-rknn" in log
    hook = (REPO / "image/profiles/rk3588/customize-image.sh").read_text()
    assert "Environment=NCM_RKNN_PYTHON=" in hook and 'rknn-converter.txt' in hook
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("no-compile", "has no compile.sh"),
        ("no-board", "has no board 'rock-5b'"),
        ("foreign-customize", "is not ncm's"),
    ],
)
def test_rk3588_dry_run_refuses_a_wrong_tree(armbian: Path, change: str, message: str) -> None:
    if change == "no-compile":
        (armbian / "compile.sh").unlink()
    elif change == "no-board":
        (armbian / "config/boards/rock-5b.conf").unlink()
    else:
        stub_file(armbian / "userpatches/customize-image.sh", "#!/bin/bash\n# someone else's\n")
    result = build("rk3588", "--armbian-dir", str(armbian), "--dry-run")
    assert result.returncode != 0 and message in result.stderr


def test_rk3588_bad_setup_file_is_caught_before_building(armbian: Path, tmp_path: Path) -> None:
    setup = tmp_path / "ncm-setup.txt"
    setup.write_text("cluster_name = kitchen\nprot = 8080\n")
    result = build("rk3588", "--armbian-dir", str(armbian), "--setup", str(setup), "--dry-run")
    assert result.returncode != 0 and "line 2: unknown setting 'prot'" in result.stderr


def test_customize_image_runs_the_shared_installer() -> None:
    text = (REPO / "image/profiles/rk3588/customize-image.sh").read_text()
    assert text.startswith("#!/bin/bash\n# ncm: Armbian")
    assert 'bash "$payload/install-agent" --payload "$payload" --boot-dir /boot' in text


# ------------------------------------------------------------------------------- jetson


def l4t_tree(root: Path, release_line: str) -> Path:
    """A stub Linux_for_Tegra after apply_binaries.sh: scripts, a board config, a rootfs."""
    tree = root / "Linux_for_Tegra"
    for script in ("flash.sh", "apply_binaries.sh", "tools/l4t_create_default_user.sh",
                   "tools/kernel_flash/l4t_initrd_flash.sh"):
        stub_file(tree / script)
    (tree / "jetson-orin-nano-devkit.conf").write_text("# stub board config\n")
    (tree / "jetson-agx-orin-devkit.conf").write_text("# stub board config\n")
    (tree / "rootfs/usr/bin").mkdir(parents=True)
    (tree / "rootfs/etc").mkdir(parents=True)
    if release_line:
        (tree / "rootfs/etc/nv_tegra_release").write_text(release_line + "\n")
    return tree


R36 = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8 01:49:37 UTC 2025"


def test_jetson_dry_run(tmp_path: Path) -> None:
    tree = l4t_tree(tmp_path, R36)
    before = snapshot(tree)
    ort = tmp_path / "onnxruntime_gpu-1.20.0-cp310-cp310-linux_aarch64.whl"
    ort.write_bytes(b"stub wheel for the dry run")
    result = build("jetson", "--l4t-dir", str(tree), "--ort-wheel", str(ort), "--work", str(tmp_path / "work"),
                   "--dry-run")
    assert result.returncode == 0, result.stderr
    log = result.stdout + result.stderr
    assert "L4T R36.4.3 (JetPack 6.x, Python 3.10)" in log
    assert f"chroot {tree}/rootfs /bin/bash /tmp/ncm-payload/install-agent --payload /tmp/ncm-payload" in result.stdout
    assert "--replace-onnxruntime" in result.stdout
    assert "./tools/l4t_create_default_user.sh -u ncm-admin" in result.stdout and "--accept-license" in result.stdout
    assert "sudo ./flash.sh jetson-orin-nano-devkit internal" in result.stdout
    assert snapshot(tree) == before, "the dry run changed Linux_for_Tegra"
    assert not (tmp_path / "work").exists()


def test_jetson_dry_run_nvme(tmp_path: Path) -> None:
    tree = l4t_tree(tmp_path, R36)
    result = build("jetson", "--l4t-dir", str(tree), "--board", "jetson-agx-orin-devkit", "--storage", "nvme",
                   "--user", "alice", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "l4t_initrd_flash.sh --external-device nvme0n1p1" in result.stdout
    assert "jetson-agx-orin-devkit internal" in result.stdout
    assert "-u alice" in result.stdout
    assert "no --ort-wheel" in result.stderr


@pytest.mark.parametrize(
    ("release", "args", "message"),
    [
        ("", [], "run 'sudo ./apply_binaries.sh'"),
        ("# R35 (release), REVISION: 5.0, GCID: 1, BOARD: t186ref, EABI: aarch64, DATE: x", [], "JetPack before 6"),
        (R36, ["--board", "jetson-nano-devkit"], "unknown board"),
        (R36, ["--storage", "floppy"], "--storage is sd, nvme or usb"),
        (R36, ["--user", "Bad User"], "not a valid user name"),
    ],
)
def test_jetson_dry_run_refuses(tmp_path: Path, release: str, args: list[str], message: str) -> None:
    tree = l4t_tree(tmp_path, release)
    result = build("jetson", "--l4t-dir", str(tree), *args, "--dry-run")
    assert result.returncode != 0
    assert message in result.stderr


def test_jetson_needs_a_password_file_for_real(tmp_path: Path) -> None:
    tree = l4t_tree(tmp_path, R36)
    result = build("jetson", "--l4t-dir", str(tree))
    assert result.returncode != 0 and "--password-file is required" in result.stderr
