# Profile jetson: prepares NVIDIA's Linux_for_Tegra (L4T) root file system for flashing
# (sourced by image/build). The person downloads the Jetson Linux BSP and sample root file
# system from NVIDIA and runs apply_binaries.sh (see docs/flashing.md); this profile then
# installs the agent with the shared installer in a chroot of Linux_for_Tegra/rootfs,
# creates the default user without the on-screen wizard, and prints (or runs) the flash
# command.

profile_usage() {
    cat <<'USAGE'
image/build jetson --l4t-dir DIR --board BOARD [options]

  --l4t-dir DIR          the Linux_for_Tegra directory, after sudo ./apply_binaries.sh
  --board BOARD          flash.sh board config (default jetson-orin-nano-devkit; e.g.
                         jetson-agx-orin-devkit)
  --storage DEV          where the system goes: sd (default: internal/SD card of the
                         devkit), nvme (NVMe SSD via l4t_initrd_flash.sh) or usb
  --user NAME            default login user (default ncm-admin)
  --password-file FILE   file holding that user's password (required unless --dry-run)
  --setup FILE           ncm-setup.txt to put into /boot (default: the template)
  --ort-wheel FILE       onnxruntime-gpu wheel (CUDA / TensorRT) built for this JetPack;
                         replaces the CPU onnxruntime
  --wheel FILE           use this ncm wheel instead of building one from the tree
  --work DIR             build cache (default: $XDG_CACHE_HOME/ncm-image or ~/.cache/ncm-image)
  --flash                run the flash command (board in recovery mode, USB connected)
  --dry-run              check the tree and print every step; write nothing, run nothing
USAGE
}

# "# R36 (release), REVISION: 4.3, ..." -> "36.4.3"
l4t_release() {
    sed -n 's/^# R\([0-9]*\) (release), REVISION: \([0-9.]*\).*/\1.\2/p' "$1" | head -n 1
}

profile_main() {
    local l4t="" board=jetson-orin-nano-devkit storage=sd user=ncm-admin password_file="" setup=""
    local ort_wheel="" flash=no work="${XDG_CACHE_HOME:-$HOME/.cache}/ncm-image"
    while [ $# -gt 0 ]; do
        case "$1" in
            --l4t-dir) l4t="$2"; shift 2 ;;
            --board) board="$2"; shift 2 ;;
            --storage) storage="$2"; shift 2 ;;
            --user) user="$2"; shift 2 ;;
            --password-file) password_file="$2"; shift 2 ;;
            --setup) setup="$2"; shift 2 ;;
            --ort-wheel) ort_wheel="$2"; shift 2 ;;
            --wheel) NCM_WHEEL="$2"; shift 2 ;;
            --work) work="$2"; shift 2 ;;
            --flash) flash=yes; shift ;;
            --dry-run) DRY_RUN=yes; shift ;;
            -h|--help) profile_usage; exit 0 ;;
            *) profile_usage >&2; die "unknown option $1" ;;
        esac
    done

    [ -n "$l4t" ] || die "--l4t-dir is required (the Linux_for_Tegra directory)"
    l4t=$(cd "$l4t" 2>/dev/null && pwd) || die "--l4t-dir does not exist"
    local file
    for file in flash.sh apply_binaries.sh tools/l4t_create_default_user.sh; do
        [ -f "$l4t/$file" ] || die "$l4t/$file is missing: is this NVIDIA's Linux_for_Tegra directory?"
    done
    [ -f "$l4t/$board.conf" ] || die "unknown board '$board': $l4t/$board.conf does not exist"
    local rootfs="$l4t/rootfs"
    [ -d "$rootfs/usr" ] || die "$rootfs is empty: extract NVIDIA's sample root file system there first"
    [ -f "$rootfs/etc/nv_tegra_release" ] \
        || die "$rootfs has no /etc/nv_tegra_release: run 'sudo ./apply_binaries.sh' in $l4t first"
    [[ "$user" =~ ^[a-z_][a-z0-9_-]{0,31}$ ]] || die "--user '$user' is not a valid user name"
    [ -z "$ort_wheel" ] || [ -f "$ort_wheel" ] || die "--ort-wheel $ort_wheel does not exist"
    case "$storage" in sd|nvme|usb) ;; *) die "--storage is sd, nvme or usb" ;; esac
    if [ "$DRY_RUN" != yes ]; then
        [ -n "$password_file" ] || die "--password-file is required (the default user's password)"
        [ -f "$password_file" ] || die "--password-file $password_file does not exist"
    fi
    check_setup_file "$setup"

    local release major jetpack pyver glibc_minor python
    release=$(l4t_release "$rootfs/etc/nv_tegra_release")
    [ -n "$release" ] || die "cannot read the L4T release from $rootfs/etc/nv_tegra_release"
    major=${release%%.*}
    case "$major" in
        36) jetpack="6.x"; pyver=3.10; glibc_minor=35; python=python3 ;;
        38) jetpack="7.x"; pyver=3.12; glibc_minor=39; python=python3 ;;
        *) die "L4T R$release (JetPack before 6) is not supported: the agent needs Python >= 3.10" ;;
    esac
    local requires
    requires=$(sed -n 's/^requires-python *= *"\(.*\)"/\1/p' "$REPO_ROOT/pyproject.toml")
    if ! "$HOST_PYTHON" -c 'import sys; v=tuple(map(int, sys.argv[1].split("."))); spec=sys.argv[2].replace(" ","")
ok = all(v >= tuple(map(int, s[2:].split("."))) for s in spec.split(",") if s.startswith(">="))
sys.exit(0 if ok else 1)' "$pyver" "${requires:->=3.10}"; then
        if [ "$DRY_RUN" = yes ]; then
            warn "the project requires Python $requires but JetPack $jetpack has $pyver: a real build would stop here"
        else
            die "the project requires Python $requires but JetPack $jetpack has Python $pyver"
        fi
    fi
    [ -n "$ort_wheel" ] || warn "no --ort-wheel: the agent will run on the CPU (onnxruntime from PyPI has no CUDA/TensorRT for Jetson)"

    local flash_cmd
    case "$storage" in
        sd) flash_cmd=(./flash.sh "$board" internal) ;;
        usb) flash_cmd=(./tools/kernel_flash/l4t_initrd_flash.sh --external-device sda1
                -c tools/kernel_flash/flash_l4t_external.xml -p "-c bootloader/generic/cfg/flash_t234_qspi.xml"
                --showlogs --network usb0 "$board" internal) ;;
        nvme) flash_cmd=(./tools/kernel_flash/l4t_initrd_flash.sh --external-device nvme0n1p1
                -c tools/kernel_flash/flash_l4t_t234_nvme.xml -p "-c bootloader/generic/cfg/flash_t234_qspi.xml"
                --showlogs --network usb0 "$board" internal) ;;
    esac
    local payload_in_root=/tmp/ncm-payload wheelhouse="$work/wheels-arm64-py$pyver-jetson"
    local install_cmd=(chroot "$rootfs" /bin/bash "$payload_in_root/install-agent" --payload "$payload_in_root"
        --python "$python" --boot-dir /boot)
    [ -z "$ort_wheel" ] || install_cmd+=(--replace-onnxruntime)

    log "L4T R$release (JetPack $jetpack, Python $pyver) in $l4t, board $board, storage $storage"
    if [ "$DRY_RUN" = yes ]; then
        log "would build the ncm wheel and download its dependencies for arm64 / Python $pyver into $wheelhouse"
        [ -z "$ort_wheel" ] || log "would install $(basename "$ort_wheel") in place of onnxruntime"
        log "would stage the installer payload into $rootfs$payload_in_root"
        log "would mount /proc, /sys, /dev into $rootfs and run (arm64 under qemu-user-static):"
        run "${install_cmd[@]}"
        log "would create the default user without the first-boot wizard:"
        (cd "$l4t" && run ./tools/l4t_create_default_user.sh -u "$user" -p '<from --password-file>' -n ncm --accept-license)
        log "flash command (board in recovery mode, connected over USB):"
        (cd "$l4t" && run sudo "${flash_cmd[@]}")
        return 0
    fi

    need_root jetson
    need_tools chroot mount "$HOST_PYTHON"
    if [ "$(dpkg --print-architecture 2>/dev/null || uname -m)" != arm64 ] && [ "$(uname -m)" != aarch64 ]; then
        need_tools arch-test
        arch-test arm64 >/dev/null 2>&1 || die "cannot run arm64 binaries: install qemu-user-static and binfmt-support"
    fi
    build_wheelhouse "$wheelhouse" arm64 "$pyver" "$glibc_minor"
    local extra=()
    [ -z "$ort_wheel" ] || extra=("$ort_wheel")
    stage_payload "$rootfs$payload_in_root" "$wheelhouse" "$setup" "${extra[@]}"
    trap 'chroot_umount "$rootfs"; rm -rf "$rootfs$payload_in_root"' EXIT
    chroot_mount "$rootfs"
    "${install_cmd[@]}"
    chroot_umount "$rootfs"
    rm -rf "${rootfs:?}$payload_in_root"
    trap - EXIT

    log "creating the default user $user"
    local password
    password=$(head -n 1 "$password_file")
    (cd "$l4t" && ./tools/l4t_create_default_user.sh -u "$user" -p "$password" -n ncm --accept-license >/dev/null)
    if [ "$flash" = yes ]; then
        log "flashing (board in recovery mode over USB)"
        (cd "$l4t" && "${flash_cmd[@]}")
    else
        log "ready to flash. Put the board in recovery mode, connect USB, then run in $l4t:"
        printf '    sudo'; printf ' %q' "${flash_cmd[@]}"; printf '\n'
    fi
}
