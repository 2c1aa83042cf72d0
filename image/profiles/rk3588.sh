# Profile rk3588: an Armbian image for RK3588 boards (Rock 5B, Orange Pi 5...), sourced by
# image/build. It stages Armbian `userpatches/` (a build config, customize-image.sh and
# the installer payload in userpatches/overlay/ncm) into an Armbian build checkout and runs
# ./compile.sh there. The kernel is Armbian's `vendor` branch: the RKNPU driver and the
# RKNN runtime need Rockchip's kernel.

profile_usage() {
    cat <<'USAGE'
image/build rk3588 --armbian-dir DIR [options]

  --armbian-dir DIR      a checkout of Armbian's build framework (has compile.sh)
  --board BOARD          Armbian board name (default rock-5b; e.g. orangepi5, orangepi5-plus)
  --release RELEASE      Armbian userspace release (default bookworm)
  --setup FILE           ncm-setup.txt to put on the boot partition (default: the template)
  --wheel FILE           use this ncm wheel instead of building one from the tree
  --rknn-runtime FILE    librknnrt.so to install (from Rockchip's rknpu2 release that
                         matches rknn-toolkit-lite2); without it the NPU is not usable
  --no-rknn              do not install rknn-toolkit-lite2
  --rknn-converter       also put the RKNN converter (rknn-toolkit2, with torch: about
                         700 MB) in its own environment, so the board converts fragments
                         for its NPU itself (else copy converted .rknn files onto it)
  --work DIR             build cache (default: $XDG_CACHE_HOME/ncm-image or ~/.cache/ncm-image)
  --dry-run              check the tree and print every step; write nothing, run nothing
USAGE
}

profile_main() {
    local armbian="" board=rock-5b release=bookworm setup="" rknn_runtime="" rknn=yes converter=no
    local work="${XDG_CACHE_HOME:-$HOME/.cache}/ncm-image"
    while [ $# -gt 0 ]; do
        case "$1" in
            --armbian-dir) armbian="$2"; shift 2 ;;
            --board) board="$2"; shift 2 ;;
            --release) release="$2"; shift 2 ;;
            --setup) setup="$2"; shift 2 ;;
            --wheel) NCM_WHEEL="$2"; shift 2 ;;
            --rknn-runtime) rknn_runtime="$2"; shift 2 ;;
            --no-rknn) rknn=no; shift ;;
            --rknn-converter) converter=yes; shift ;;
            --work) work="$2"; shift 2 ;;
            --dry-run) DRY_RUN=yes; shift ;;
            -h|--help) profile_usage; exit 0 ;;
            *) profile_usage >&2; die "unknown option $1" ;;
        esac
    done

    [ -n "$armbian" ] || die "--armbian-dir is required (a checkout of Armbian's build framework)"
    [ -f "$armbian/compile.sh" ] || die "$armbian has no compile.sh: is it an Armbian build checkout?"
    local board_conf
    board_conf=$(find "$armbian/config/boards" -maxdepth 1 -name "$board.*" 2>/dev/null | head -n 1)
    [ -n "$board_conf" ] || die "Armbian has no board '$board' (looked for config/boards/$board.*)"
    grep -qiE 'rk3588|rockchip-rk3588' "$board_conf" \
        || warn "$board_conf does not mention rk3588: this profile is meant for RK3588 boards"
    local pyver glibc_minor
    case "$release" in
        bookworm) pyver=3.11; glibc_minor=36 ;;
        trixie) pyver=3.13; glibc_minor=41 ;;
        noble) pyver=3.12; glibc_minor=39 ;;
        jammy) pyver=3.10; glibc_minor=35 ;;
        *) die "unsupported release $release (bookworm, trixie, noble or jammy)" ;;
    esac
    [ -z "$rknn_runtime" ] || [ -f "$rknn_runtime" ] || die "--rknn-runtime $rknn_runtime does not exist"
    check_setup_file "$setup"

    local userpatches="$armbian/userpatches" payload="$armbian/userpatches/overlay/ncm"
    local config_name=ncm-rk3588 wheelhouse="$work/wheels-arm64-py$pyver-rk3588"
    local converter_wheels="$work/rknn-converter-arm64-py$pyver"
    if [ -e "$userpatches/customize-image.sh" ] && ! grep -q '^# ncm: Armbian' "$userpatches/customize-image.sh"; then
        die "$userpatches/customize-image.sh exists and is not ncm's: merge it by hand or move it away"
    fi

    local config
    config=$(cat <<CONF
# ncm: Armbian build configuration, written by image/build rk3588.
# ./compile.sh $config_name
BOARD=$board
# Rockchip's kernel: the RKNPU driver and the RKNN runtime need it.
BRANCH=vendor
RELEASE=$release
BUILD_MINIMAL=yes
BUILD_DESKTOP=no
KERNEL_CONFIGURE=no
# A FAT boot partition, so that ncm-setup.txt can be edited from any computer.
BOOTFS_TYPE=fat
BOOTSIZE=256
COMPRESS_OUTPUTIMAGE=sha,img,xz
CONF
)

    if [ "$DRY_RUN" = yes ]; then
        log "dry run: Armbian $release (vendor kernel) for $board in $armbian"
        log "would build the ncm wheel and download its dependencies for arm64 / Python $pyver into $wheelhouse"
        [ "$rknn" = yes ] && log "would add rknn-toolkit-lite2 (aarch64, Python $pyver) as an extra wheel"
        [ "$converter" = yes ] && log "would download the RKNN converter ($(grep -E '^rknn-toolkit2==' \
            "$IMAGE_DIR/rknn-converter.txt"), its requirements and torch; aarch64, Python $pyver) into" \
            "$converter_wheels, for /opt/ncm-rknn on the board"
        if [ -n "$rknn_runtime" ]; then
            log "would install $rknn_runtime as /usr/lib/librknnrt.so"
        else
            warn "no --rknn-runtime: the image will not reach the NPU until librknnrt.so is installed"
        fi
        log "would stage the installer payload into $payload"
        log "would write $userpatches/customize-image.sh (from image/profiles/rk3588/customize-image.sh)"
        log "would write $userpatches/config-$config_name.conf:"
        printf '%s\n' "$config" | sed 's/^/    /' >&2
        (cd "$armbian" && run ./compile.sh "$config_name")
        log "the image would be in $armbian/output/images/"
        return 0
    fi

    need_tools "$HOST_PYTHON"
    local extra=()
    if [ "$rknn" = yes ]; then
        build_wheelhouse "$wheelhouse" arm64 "$pyver" "$glibc_minor" rknn-toolkit-lite2
        mapfile -t extra < <(find "$wheelhouse" -maxdepth 1 -name 'rknn_toolkit_lite2-*.whl')
        [ ${#extra[@]} -gt 0 ] || die "rknn-toolkit-lite2 has no wheel for Python $pyver on aarch64"
    else
        build_wheelhouse "$wheelhouse" arm64 "$pyver" "$glibc_minor"
    fi
    mkdir -p "$userpatches/overlay"
    stage_payload "$payload" "$wheelhouse" "$setup" "${extra[@]}"
    if [ -n "$rknn_runtime" ]; then
        mkdir -p "$payload/rknn"
        cp "$rknn_runtime" "$payload/rknn/librknnrt.so"
    fi
    if [ "$converter" = yes ]; then
        download_rknn_converter "$converter_wheels" "$pyver" "$glibc_minor"
        mkdir -p "$payload/rknn-converter"
        cp "$converter_wheels"/*.whl "$IMAGE_DIR/rknn-converter.txt" "$payload/rknn-converter/"
    fi
    install -m 0755 "$IMAGE_DIR/profiles/rk3588/customize-image.sh" "$userpatches/customize-image.sh"
    printf '%s\n' "$config" >"$userpatches/config-$config_name.conf"
    log "running Armbian's build (this takes a long time and needs its own prerequisites)"
    (cd "$armbian" && ./compile.sh "$config_name")
    log "done: the image is in $armbian/output/images/"
}

# download_rknn_converter DIR PYVER GLIBC_MINOR: rknn-toolkit2 (without its dependencies),
# the requirements of image/rknn-converter.txt and torch, as aarch64 wheels.
download_rknn_converter() {
    local dir="$1" pyver="$2" glibc_minor="$3" requirements="$IMAGE_DIR/rknn-converter.txt"
    local flags=(--quiet --disable-pip-version-check --only-binary=:all: --implementation cp
                 --python-version "$pyver" --abi "cp${pyver/./}" --abi abi3 --abi none --platform any --dest "$dir")
    # shellcheck disable=SC2207
    flags+=($(manylinux_platforms aarch64 "$glibc_minor"))
    rm -rf "$dir"
    mkdir -p "$dir"
    log "downloading the RKNN converter for aarch64 / Python $pyver into $dir"
    "$HOST_PYTHON" -m pip download "${flags[@]}" --no-deps "$(grep -E '^rknn-toolkit2==' "$requirements")" \
        || die "rknn-toolkit2 has no aarch64 wheel for Python $pyver"
    "$HOST_PYTHON" -m pip download "${flags[@]}" -r <(grep -vE '^(#|rknn-toolkit2==|$)' "$requirements") torch \
        || die "cannot download the RKNN converter's requirements for aarch64 / Python $pyver"
}
