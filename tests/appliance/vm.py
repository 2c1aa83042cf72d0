"""Helpers of the image tests: disk image inspection with mtools, and a qemu VM.

Nothing here mounts anything: the ESP of a raw image is read and written with mtools at
the partition's byte offset, so the tests need no loop devices or vfat driver.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.deadlines import Deadline

ESP_TYPE = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
ROOT_TYPES = {
    "amd64": "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709",
    "arm64": "B921B045-1DF0-41C3-AF44-4C6F280D3FAE",
}


@dataclass(frozen=True)
class Partition:
    number: int
    start_bytes: int
    size_bytes: int
    type_guid: str
    uuid: str
    name: str


def partitions(image: Path) -> list[Partition]:
    out = subprocess.run(["sfdisk", "--json", str(image)], check=True, capture_output=True, text=True).stdout
    table = json.loads(out)["partitiontable"]
    sector = int(table.get("sectorsize", 512))
    result = []
    for index, part in enumerate(table["partitions"], start=1):
        result.append(Partition(index, int(part["start"]) * sector, int(part["size"]) * sector,
                                part["type"].upper(), part.get("uuid", "").upper(), part.get("name", "")))
    return result


def esp_of(image: Path) -> Partition:
    for part in partitions(image):
        if part.type_guid == ESP_TYPE:
            return part
    raise AssertionError(f"{image} has no EFI system partition")


def esp_read(image: Path, name: str) -> str:
    offset = esp_of(image).start_bytes
    data = subprocess.run(["mtype", "-i", f"{image}@@{offset}", f"::{name}"], check=True, capture_output=True).stdout
    return data.decode("utf-8", "replace")  # as stored: CRLF line ends stay


def esp_files(image: Path) -> set[str]:
    """Every file path on the ESP, e.g. ``EFI/BOOT/BOOTX64.EFI``."""
    offset = esp_of(image).start_bytes
    out = subprocess.run(["mdir", "-/", "-b", "-i", f"{image}@@{offset}", "::"], check=True,
                         capture_output=True, text=True).stdout
    return {line.removeprefix("::/").strip() for line in out.splitlines() if line.strip()}


def esp_write(image: Path, name: str, content: str, scratch: Path) -> None:
    offset = esp_of(image).start_bytes
    local = scratch / Path(name).name
    local.write_text(content, newline="")
    subprocess.run(["mcopy", "-o", "-i", f"{image}@@{offset}", str(local), f"::{name}"], check=True,
                   capture_output=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], object], deadline_s: float, what: str,
               alive: Callable[[], str | None] | None = None, poll_s: float = 1.0) -> object:
    """Poll ``predicate`` until it returns something truthy or the deadline passes.

    ``alive`` returns an error text when the thing being waited on died (stop early).
    """
    deadline = Deadline(deadline_s)
    while True:
        value = predicate()
        if value:
            return value
        if alive is not None:
            problem = alive()
            if problem:
                raise AssertionError(f"while waiting for {what}: {problem}")
        if deadline.expired():
            raise AssertionError(f"timed out after {deadline.describe()} waiting for {what}")
        # Waiting on a condition with a deadline: each poll is bounded by poll_s.
        time.sleep(poll_s)


def http_json(url: str, timeout: float = 5.0) -> tuple[int, dict] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read().decode())
    except urllib.error.HTTPError as error:
        return error.code, {}
    except (OSError, ValueError):
        return None


def ovmf_files() -> tuple[Path, Path] | None:
    for code, vars_ in (("OVMF_CODE_4M.fd", "OVMF_VARS_4M.fd"), ("OVMF_CODE.fd", "OVMF_VARS.fd")):
        base = Path("/usr/share/OVMF")
        if (base / code).exists() and (base / vars_).exists():
            return base / code, base / vars_
    return None


class Vm:
    """A qemu-system-x86_64 guest booting a raw disk image through OVMF (UEFI)."""

    def __init__(self, image: Path, workdir: Path, forwards: dict[int, int], *, accel: str = "tcg",
                 memory_mb: int = 2048, cpus: int = 2) -> None:
        self.image = image
        self.workdir = workdir
        self.serial_log = workdir / "serial.log"
        self.monitor_path = workdir / "monitor.sock"
        self.forwards = forwards
        firmware = ovmf_files()
        if firmware is None:
            raise AssertionError("OVMF firmware is missing (apt-get install ovmf; image/ci-setup does it)")
        code, vars_template = firmware
        vars_copy = workdir / "OVMF_VARS.fd"
        shutil.copyfile(vars_template, vars_copy)
        hostfwd = ",".join(f"hostfwd=tcp:127.0.0.1:{host}-:{guest}" for host, guest in forwards.items())
        self.argv = [
            "qemu-system-x86_64", "-machine", "q35", "-accel", accel,
            *(["-cpu", "max"] if accel == "tcg" else ["-cpu", "host"]),
            "-m", str(memory_mb), "-smp", str(cpus), "-display", "none", "-no-reboot",
            "-drive", f"if=pflash,format=raw,readonly=on,file={code}",
            "-drive", f"if=pflash,format=raw,file={vars_copy}",
            "-drive", f"file={image},format=raw,if=virtio",
            "-netdev", f"user,id=n0,{hostfwd}", "-device", "virtio-net-pci,netdev=n0",
            "-serial", f"file:{self.serial_log}",
            "-monitor", f"unix:{self.monitor_path},server,nowait",
        ]
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def console(self) -> str:
        try:
            return self.serial_log.read_bytes().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def died(self) -> str | None:
        if self.process is not None and self.process.poll() is not None:
            output = self.process.stdout.read().decode("utf-8", "replace") if self.process.stdout else ""
            return f"qemu exited with {self.process.returncode}: {output[-2000:]}\n--- console ---\n{self.console()[-4000:]}"
        return None

    def monitor(self, command: str, timeout: float = 10.0) -> str:
        """Run one human-monitor command and return its output."""

        def read_prompt(sock: socket.socket) -> bytes:
            data = b""
            while not data.endswith(b"(qemu) "):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
            return data

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(self.monitor_path))
            read_prompt(sock)
            sock.sendall(command.encode() + b"\n")
            return read_prompt(sock).decode("utf-8", "replace")

    def wait_exit(self, timeout: float) -> int | None:
        assert self.process is not None
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
