"""image/build debian-generic, for real: the amd64 image boots under qemu-system-x86_64 and
answers /health through a forwarded port; the arm64 root file system runs the agent under
qemu-user.

These tests build images (minutes each; built once per session and shared; the arm64 one
starts with the session and builds alongside the other tests, see conftest.py). They need
root and the tools that image/ci-setup installs; they skip only when the machine itself
cannot do it (not root, no binfmt_misc for arm64).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.appliance import vm
from tests.appliance.conftest import ARM64_BINFMT, ARM64_BUILD, REPO, ImageBuild

pytestmark = pytest.mark.slow

TOOLS = ("mmdebstrap", "systemd-repart", "systemd-analyze", "mkfs.fat", "mcopy", "mtype", "mkfs.ext4", "sfdisk",
         "qemu-system-x86_64", "arch-test", "unshare")
CLUSTER_KEY = "ci-cluster-key-do-not-log-0123456789"


@dataclass(frozen=True)
class Built:
    path: Path  # the .img, or the root directory for --rootfs-only
    seconds: float
    log: str


def _require_build_capabilities() -> None:
    if os.geteuid() != 0:
        pytest.skip("image builds need root (chroot, device nodes, file ownership)")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"missing tools {missing}: run image/ci-setup (apt-get install) first")
    if vm.ovmf_files() is None:
        pytest.fail("OVMF firmware missing: run image/ci-setup first")


def _build(out: Path, work: Path, *args: str) -> tuple[float, str]:
    return ImageBuild.start(out, work, *args).wait(40 * 60)


@pytest.fixture(scope="session")
def image_work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    work = tmp_path_factory.mktemp("image-work")
    yield work
    shutil.rmtree(work, ignore_errors=True)  # gigabytes: not kept for later sessions


@pytest.fixture(scope="session")
def amd64_image(tmp_path_factory: pytest.TempPathFactory, image_work: Path) -> Iterator[Built]:
    _require_build_capabilities()
    out = tmp_path_factory.mktemp("image-amd64")
    seconds, log = _build(out, image_work, "--arch", "amd64", "--keep-rootfs")
    image = out / "ncm-debian-bookworm-amd64.img"
    assert image.is_file(), log
    print(f"\namd64 image built in {seconds:.0f} s: {image.stat().st_size / 2**30:.2f} GiB")
    yield Built(image, seconds, log)
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def arm64_rootfs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                 image_work: Path) -> Iterator[Built]:
    _require_build_capabilities()
    if not ARM64_BINFMT.exists():
        pytest.skip("binfmt_misc has no qemu-aarch64 handler here (needs a kernel with binfmt_misc and "
                    "qemu-user-static): arm64 binaries cannot run on this machine")
    early = request.config.stash.get(ARM64_BUILD, None)  # started with the session (conftest.py)
    if early is not None:
        seconds, log = early.wait(40 * 60)
        out = early.out
    else:
        out = tmp_path_factory.mktemp("image-arm64")
        seconds, log = _build(out, image_work, "--arch", "arm64", "--rootfs-only")
    root = out / "rootfs-arm64"
    assert (root / "opt/ncm/bin/ncm").exists(), log
    print(f"\narm64 root file system built in {seconds:.0f} s{' alongside the tests' if early else ''}")
    yield Built(root, seconds, log)
    shutil.rmtree(out, ignore_errors=True)


def _chroot_argv(root: Path, command: tuple[str, ...], *, sysfs: bool) -> list[str]:
    """A chroot with its own /proc (and /sys, /dev) in a private mount namespace: the mounts
    vanish with the command. No /sys for a foreign architecture: onnxruntime's CPU probe
    crashes under qemu-user when it reads the host's sysfs."""
    mounts = f'mount -t proc proc "{root}/proc" && mount --rbind /dev "{root}/dev"'
    if sysfs:
        mounts += f' && mount -t sysfs sysfs "{root}/sys"'
    return ["unshare", "--mount", "--propagation", "private", "--fork", "--kill-child=SIGTERM",
            "sh", "-c", f'{mounts} && exec chroot "{root}" "$@"', "sh", *command]


CHROOT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8"}


def _in_root(root: Path, *command: str, timeout: float = 600, sysfs: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_chroot_argv(root, command, sysfs=sysfs), capture_output=True, text=True,
                          timeout=timeout, env=CHROOT_ENV)


# ------------------------------------------------------------------------------------ amd64


def test_amd64_image_layout(amd64_image: Built) -> None:
    image = amd64_image.path
    parts = vm.partitions(image)
    assert [p.type_guid for p in parts] == [vm.ESP_TYPE, vm.ROOT_TYPES["amd64"]]
    esp, root = parts
    assert esp.size_bytes == 256 * 2**20 and root.size_bytes == 3 * 2**30  # pinned sizes, nothing truncated
    entry = vm.esp_read(image, "loader/entries/ncm.conf")
    assert f"root=PARTUUID={root.uuid}".lower() in entry.lower()
    files = vm.esp_files(image)
    assert {"EFI/BOOT/BOOTX64.EFI", "vmlinuz", "initrd.img", "ncm-setup.txt"} <= files  # systemd-boot, removable-media path
    setup = vm.esp_read(image, "ncm-setup.txt")
    assert "\r\n" in setup and "#cluster_name = home" in setup
    rootfs = image.parent / "rootfs-amd64"
    fstab = (rootfs / "etc/fstab").read_text()
    assert f"PARTUUID={esp.uuid}".lower() in fstab.lower()
    assert (rootfs / "etc/machine-id").read_text() == ""
    assert not (rootfs / "var/lib/ncm/node-id").exists()


def test_units_verify_in_the_installed_root(amd64_image: Built) -> None:
    rootfs = amd64_image.path.parent / "rootfs-amd64"
    for unit in ("ncm-agent.service", "ncm-firstboot.service", "ncm-pull.service"):
        result = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={rootfs}", unit],
                                capture_output=True, text=True, timeout=120)
        assert result.stdout + result.stderr == "", unit
    wants = rootfs / "etc/systemd/system/multi-user.target.wants"
    assert {"ncm-agent.service", "ncm-firstboot.service"} <= {p.name for p in wants.iterdir()}


def test_amd64_image_boots_and_answers_health(amd64_image: Built, tmp_path: Path) -> None:
    disk = tmp_path / "disk.img"
    subprocess.run(["cp", "--sparse=always", str(amd64_image.path), str(disk)], check=True)
    # What a person does on any computer before the first boot: edit ncm-setup.txt.
    vm.esp_write(disk, "ncm-setup.txt",
                 f"cluster_name = ci\r\ncluster_key = {CLUSTER_KEY}\r\nport = 8090\r\nhostname = ncm-ci-test\r\n",
                 tmp_path)
    # For diagnosis: the journal on the serial console.
    entry = vm.esp_read(disk, "loader/entries/ncm.conf")
    vm.esp_write(disk, "loader/entries/ncm.conf",
                 entry.replace("console=ttyS0,115200", "console=ttyS0,115200 systemd.journald.forward_to_console=1"),
                 tmp_path)

    port = vm.free_port()
    accel = os.environ.get("NCM_QEMU_ACCEL", "tcg")  # nested KVM is often unreliable on CI machines
    machine = vm.Vm(disk, tmp_path, {port: 8090}, accel=accel)
    machine.start()
    try:
        answer = vm.wait_until(lambda: vm.http_json(f"http://127.0.0.1:{port}/health", timeout=5),
                               600, "GET /health through the forwarded port", machine.died, poll_s=2)
        boot_seconds = time.monotonic() - machine.started_at
        print(f"\n/health answered {boot_seconds:.0f} s after qemu started ({accel})")
        status, body = answer  # type: ignore[misc]
        assert status == 200 and body["status"] == "ok"
        assert re.fullmatch(r"[0-9a-f]{32}", body["node_id"])

        console = machine.console()
        # Type=notify: systemd reports the unit started only once READY=1 arrived.
        assert "Started ncm-agent.service" in console
        assert "provisioned from /boot/efi/ncm-setup.txt" in console
        assert "ncm-ci-test" in console  # the hostname from the setup file
        assert f"node {body['node_id']}" in console
        assert CLUSTER_KEY not in console

        # A clean stop: ACPI power button -> systemd stops the agent with SIGTERM.
        machine.monitor("system_powerdown")
        code = machine.wait_exit(180)
        console = machine.console()
        assert code is not None, "the guest did not power off within 180 s\n" + console[-4000:]
        assert "Stopped ncm-agent.service" in console
        assert "ncm-agent.service: State 'stop-sigterm' timed out" not in console
        assert not re.search(r"ncm-agent\.service: Main process exited, code=(killed|dumped)", console)
    except BaseException:
        print(machine.console()[-8000:])
        raise
    finally:
        machine.kill()
        disk.unlink(missing_ok=True)  # a gigabyte; the serial log stays for diagnosis


def test_rk3588_customize_image_runs_the_shared_installer(amd64_image: Built, image_work: Path) -> None:
    """Armbian's hook, run as Armbian runs it (in the image chroot, with the payload under
    /tmp/overlay/ncm), here in the amd64 root file system: Armbian itself is not available."""
    rootfs = amd64_image.path.parent / "rootfs-amd64"
    payload = image_work / "ncm-debian-bookworm-amd64" / "payload"
    assert (payload / "install-agent").exists()
    shutil.copytree(payload, rootfs / "tmp/overlay/ncm", symlinks=True)
    shutil.copy(REPO / "image/profiles/rk3588/customize-image.sh", rootfs / "tmp/customize-image.sh")
    try:
        result = _in_root(rootfs, "/bin/bash", "/tmp/customize-image.sh", "bookworm", "rockchip-rk3588", "rock-5b",
                          "no", "arm64")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "install-agent: done: ncm" in result.stdout
        assert "#cluster_name = home" in (rootfs / "boot/ncm-setup.txt").read_text()
        version = _in_root(rootfs, "/opt/ncm/bin/ncm", "--version")
        assert version.returncode == 0 and version.stdout.startswith("ncm ")
    finally:
        shutil.rmtree(rootfs / "tmp/overlay", ignore_errors=True)
        (rootfs / "tmp/customize-image.sh").unlink(missing_ok=True)
        (rootfs / "boot/ncm-setup.txt").unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ arm64


def test_arm64_rootfs_runs_the_agent(arm64_rootfs: Built) -> None:
    root = arm64_rootfs.path
    python = (root / "usr/bin/python3").resolve() if (root / "usr/bin/python3").is_symlink() else root / "usr/bin/python3"
    header = (root / "usr/bin" / python.name).read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64

    version = _in_root(root, "/opt/ncm/bin/ncm", "--version", sysfs=False)
    assert version.returncode == 0, version.stderr
    assert re.fullmatch(r"ncm \S+\n", version.stdout), version.stdout

    imports = _in_root(root, "/opt/ncm/bin/python", "-c",
                       "import platform, onnxruntime, numpy, zeroconf, aiohttp, msgpack, psutil;"
                       "print(platform.machine(), onnxruntime.get_available_providers())", sysfs=False)
    assert imports.returncode == 0, imports.stderr
    assert imports.stdout.startswith("aarch64 ") and "CPUExecutionProvider" in imports.stdout

    # First boot provisioning, under emulation, into scratch paths of the root.
    (root / "tmp/boot").mkdir(parents=True, exist_ok=True)
    (root / "tmp/boot/ncm-setup.txt").write_text(f"cluster_name = arm\r\ncluster_key = {CLUSTER_KEY}\r\n")
    firstboot = _in_root(root, "/opt/ncm/bin/ncm", "firstboot", "--boot-dir", "/tmp/boot", "--config",
                         "/tmp/agent.toml", "--state-dir", "/tmp/state", "--no-hostname", sysfs=False)
    assert firstboot.returncode == 0, firstboot.stderr
    node_id = (root / "tmp/state/node-id").read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{32}", node_id)
    assert CLUSTER_KEY not in firstboot.stdout + firstboot.stderr

    # The agent itself, emulated, with the config first boot wrote (the chroot shares the
    # host's network, so its API is on the host's loopback).
    port = vm.free_port()
    log_path = root / "tmp/serve.log"
    with log_path.open("wb") as log:
        serve = subprocess.Popen(
            _chroot_argv(root, ("env", "NCM_HOME=/tmp/home", "/opt/ncm/bin/ncm", "serve", "--config", "/tmp/agent.toml",
                                "--state-dir", "/tmp/state", "--host", "127.0.0.1", "--port", str(port), "--no-mdns"),
                         sysfs=False),
            stdout=log, stderr=subprocess.STDOUT, env=CHROOT_ENV, start_new_session=True)
    try:
        def died() -> str | None:
            return None if serve.poll() is None else f"ncm serve exited {serve.returncode}: {log_path.read_text()[-3000:]}"

        answer = vm.wait_until(lambda: vm.http_json(f"http://127.0.0.1:{port}/health", timeout=5), 300,
                               "/health of the arm64 agent", died, poll_s=1)
        status, body = answer  # type: ignore[misc]
        assert status == 200 and body["node_id"] == node_id
    finally:
        # SIGTERM to the whole group: unshare itself waits for its child, the agent stops.
        os.killpg(serve.pid, signal.SIGTERM)
        try:
            code = serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            raise
    assert code == 0, log_path.read_text()[-3000:]
    assert "listening on 127.0.0.1" in log_path.read_text() and "cluster 'arm'" in log_path.read_text()
