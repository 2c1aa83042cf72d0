# Shared helpers of image/build (sourced, not run). Bash.
#
# Every profile goes through the same two steps here:
#   build_wheelhouse   the project's own wheel plus all its dependencies, for the target
#                      CPU and Python (downloaded on the build host: nothing is compiled
#                      or fetched inside an emulated chroot)
#   stage_payload      the directory the shared installer (image/install-agent) reads

log() { printf '==> %s\n' "$*" >&2; }
warn() { printf 'warning: %s\n' "$*" >&2; }
die() { printf 'image/build: error: %s\n' "$*" >&2; exit 1; }

# Print a command (shell-quoted) in dry-run mode, run it otherwise.
run() {
    if [ "${DRY_RUN:-no}" = yes ]; then
        printf '[dry-run] '; printf '%q ' "$@"; printf '\n'
    else
        "$@"
    fi
}

need_root() {
    [ "$(id -u)" = 0 ] || die "$1 needs root (loop devices, chroot, file ownership)"
}

need_tools() {
    local missing=() tool
    for tool in "$@"; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    [ ${#missing[@]} -eq 0 ] || die "missing tools: ${missing[*]} (image/ci-setup installs them on Debian)"
}

# Debian architecture name -> the machine names used by wheels and EFI.
wheel_machine() {
    case "$1" in
        amd64) echo x86_64 ;;
        arm64) echo aarch64 ;;
        *) die "unsupported architecture $1 (amd64 or arm64)" ;;
    esac
}

# The manylinux platform tags a glibc of version 2.$2 accepts, for machine $1.
manylinux_platforms() {
    local machine="$1" glibc_minor="$2" minor
    printf -- '--platform manylinux2014_%s ' "$machine"
    for ((minor = 17; minor <= glibc_minor; minor++)); do
        printf -- '--platform manylinux_2_%s_%s ' "$minor" "$machine"
    done
}

# build_wheel OUT_DIR: the project's wheel (skipped when --wheel was given).
build_wheel() {
    local out="$1"
    mkdir -p "$out"
    if [ -n "${NCM_WHEEL:-}" ]; then
        [ -f "$NCM_WHEEL" ] || die "--wheel $NCM_WHEEL does not exist"
        cp "$NCM_WHEEL" "$out/"
        return
    fi
    log "building the ncm wheel from $REPO_ROOT"
    "$HOST_PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$out" "$REPO_ROOT" \
        || die "cannot build the wheel (is pip installed for $HOST_PYTHON?)"
}

# build_wheelhouse DIR ARCH PYVER GLIBC_MINOR [EXTRA_REQUIREMENT...]
build_wheelhouse() {
    local dir="$1" arch="$2" pyver="$3" glibc_minor="$4"
    shift 4
    local machine abi wheel
    machine=$(wheel_machine "$arch")
    abi="cp${pyver/./}"
    rm -rf "$dir"
    mkdir -p "$dir"
    build_wheel "$dir"
    wheel=$(find "$dir" -maxdepth 1 -name 'ncm-*.whl' | head -n 1)
    [ -n "$wheel" ] || die "no ncm wheel was built"
    log "downloading dependencies for $arch / Python $pyver into $dir"
    # shellcheck disable=SC2046
    "$HOST_PYTHON" -m pip download --quiet --disable-pip-version-check \
        --only-binary=:all: --implementation cp --python-version "$pyver" --abi "$abi" --abi abi3 --abi none \
        $(manylinux_platforms "$machine" "$glibc_minor") --platform any \
        --dest "$dir" "$wheel" "$@" \
        || die "cannot download the dependencies for $arch (PyPI reachable? wheels for Python $pyver?)"
}

# stage_payload DIR WHEELHOUSE SETUP_FILE [EXTRA_WHEEL...]
stage_payload() {
    local dir="$1" wheelhouse="$2" setup="$3"
    shift 3
    rm -rf "$dir"
    mkdir -p "$dir/wheels" "$dir/systemd" "$dir/overlay" "$dir/doc"
    cp "$IMAGE_DIR/install-agent" "$dir/install-agent"
    chmod 0755 "$dir/install-agent"
    cp "$wheelhouse"/*.whl "$dir/wheels/"
    cp -r "$REPO_ROOT/systemd/." "$dir/systemd/"
    cp -r "$IMAGE_DIR/overlay/." "$dir/overlay/"
    cp "$REPO_ROOT/docs/flashing.md" "$dir/doc/"
    if [ -n "$setup" ]; then
        [ -f "$setup" ] || die "--setup $setup does not exist"
        cp "$setup" "$dir/ncm-setup.txt"
    else
        cp "$IMAGE_DIR/overlay/usr/share/ncm/ncm-setup.txt" "$dir/ncm-setup.txt"
    fi
    if [ $# -gt 0 ]; then
        mkdir -p "$dir/extra-wheels"
        cp "$@" "$dir/extra-wheels/"
    fi
}

# Validate a setup file on the build host before it goes into an image, with the same
# parser the device uses.
check_setup_file() {
    [ -n "$1" ] || return 0
    PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$HOST_PYTHON" -c '
import sys
from pathlib import Path
from agent.cli.firstboot import read_setup_file
from agent.cli.setup_file import FirstbootError
try:
    read_setup_file(Path(sys.argv[1]))
except FirstbootError as error:
    sys.exit(f"image/build: error: {error}")
' "$1"
}

# Mounts for a chroot into a foreign or vendor root file system; undone by chroot_umount.
chroot_mount() {
    local root="$1"
    mount -t proc proc "$root/proc"
    mount -t sysfs sysfs "$root/sys"
    mount --bind /dev "$root/dev"
    mount --bind /dev/pts "$root/dev/pts"
}

chroot_umount() {
    local root="$1" path
    for path in dev/pts dev sys proc; do
        if mountpoint -q "$root/$path"; then umount -l "$root/$path"; fi
    done
}
