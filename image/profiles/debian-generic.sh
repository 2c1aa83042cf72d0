# Profile debian-generic: a Debian image for PCs and UEFI arm64 boards (sourced by
# image/build). Steps: mmdebstrap (qemu-user-static for a foreign architecture) → the
# shared installer in a chroot → systemd-boot on an EFI system partition → one raw .img
# made by systemd-repart with pinned partition sizes.

profile_usage() {
    cat <<'EOF'
image/build debian-generic [options]

  --arch ARCH            amd64 (default) or arm64
  --suite SUITE          Debian release: bookworm (default) or trixie
  --mirror URL           Debian mirror (default: mmdebstrap's default)
  --out DIR              where the image goes (default: ./ncm-images)
  --work DIR             build cache (default: $XDG_CACHE_HOME/ncm-image or ~/.cache/ncm-image)
  --root-size SIZE       root partition size, e.g. 3G (default 3G; it grows to fill the
                         card on first boot)
  --esp-size SIZE        EFI system partition size (default 256M)
  --setup FILE           ncm-setup.txt to put on the boot partition (default: the
                         commented template)
  --wheel FILE           use this ncm wheel instead of building one from the tree
  --extra-packages LIST  more Debian packages, comma-separated (e.g. openssh-server)
  --authorized-keys FILE SSH public keys for root (needs openssh-server)
  --keep-rootfs          keep the root directory next to the image (rootfs-ARCH/)
  --rootfs-only          only the root directory (out/rootfs-ARCH/), without kernel,
                         boot loader or image: quick, for checking the agent under emulation
  --xz                   also write a compressed .img.xz
  --dry-run              print the steps, write nothing
EOF
}

profile_main() {
    local arch=amd64 suite=bookworm mirror="" out="$PWD/ncm-images" work="${XDG_CACHE_HOME:-$HOME/.cache}/ncm-image"
    local root_size=3G esp_size=256M setup="" extra_packages="" authorized_keys="" keep_rootfs=no xz=no rootfs_only=no
    while [ $# -gt 0 ]; do
        case "$1" in
            --arch) arch="$2"; shift 2 ;;
            --suite) suite="$2"; shift 2 ;;
            --mirror) mirror="$2"; shift 2 ;;
            --out) out="$2"; shift 2 ;;
            --work) work="$2"; shift 2 ;;
            --root-size) root_size="$2"; shift 2 ;;
            --esp-size) esp_size="$2"; shift 2 ;;
            --setup) setup="$2"; shift 2 ;;
            --wheel) NCM_WHEEL="$2"; shift 2 ;;
            --extra-packages) extra_packages="$2"; shift 2 ;;
            --authorized-keys) authorized_keys="$2"; shift 2 ;;
            --keep-rootfs) keep_rootfs=yes; shift ;;
            --rootfs-only) rootfs_only=yes; shift ;;
            --xz) xz=yes; shift ;;
            --dry-run) DRY_RUN=yes; shift ;;
            -h|--help) profile_usage; exit 0 ;;
            *) profile_usage >&2; die "unknown option $1" ;;
        esac
    done

    local pyver glibc_minor efi_name console kernel_pkg root_type
    case "$suite" in
        bookworm) pyver=3.11; glibc_minor=36 ;;
        trixie) pyver=3.13; glibc_minor=41 ;;
        *) die "unsupported suite $suite (bookworm or trixie)" ;;
    esac
    case "$arch" in
        amd64) efi_name=BOOTX64.EFI; console=ttyS0; kernel_pkg=linux-image-amd64; root_type=root-x86-64 ;;
        arm64) efi_name=BOOTAA64.EFI; console=ttyAMA0; kernel_pkg=linux-image-arm64; root_type=root-arm64 ;;
        *) die "unsupported architecture $arch (amd64 or arm64)" ;;
    esac
    for size in "$root_size" "$esp_size"; do
        [[ "$size" =~ ^[0-9]+[MG]$ ]] || die "sizes are like 512M or 3G, not '$size'"
    done
    [ -z "$authorized_keys" ] || [ -f "$authorized_keys" ] || die "--authorized-keys $authorized_keys does not exist"
    check_setup_file "$setup"

    local packages="systemd,systemd-sysv,systemd-resolved,systemd-timesyncd,udev,dbus,libpam-systemd,kmod"
    packages+=",iproute2,iputils-ping,ca-certificates,python3,python3-venv,e2fsprogs,dosfstools"
    # avahi answers for the device's name (ncm-xxxxxx.local) and nss-mdns resolves the
    # peers' names; the agent does its own service discovery next to it.
    packages+=",avahi-daemon,libnss-mdns,less,nano"
    [ "$rootfs_only" = yes ] || packages+=",initramfs-tools,systemd-boot-efi,$kernel_pkg"
    [ -z "$extra_packages" ] || packages+=",$extra_packages"

    local name="ncm-debian-$suite-$arch"
    local img="$out/$name.img" build="$work/$name" rootfs="$work/$name/rootfs" esp="$work/$name/esp"
    local payload="$work/$name/payload" wheelhouse="$work/wheels-$arch-py$pyver"

    if [ "$DRY_RUN" = yes ]; then
        log "dry run: $img from Debian $suite/$arch, root $root_size, ESP $esp_size"
    else
        need_root "debian-generic"
        need_tools mmdebstrap systemd-repart mkfs.fat mcopy mkfs.ext4 "$HOST_PYTHON"
        if [ "$arch" != "$(dpkg --print-architecture 2>/dev/null || echo amd64)" ]; then
            need_tools arch-test
            arch-test "$arch" >/dev/null 2>&1 \
                || die "cannot run $arch binaries: install qemu-user-static and binfmt-support"
        fi
    fi
    local started=$SECONDS

    run mkdir -p "$out" "$build"
    if [ "$DRY_RUN" = yes ]; then
        log "would build the ncm wheel and download its dependencies for $arch / Python $pyver into $wheelhouse"
    else
        build_wheelhouse "$wheelhouse" "$arch" "$pyver" "$glibc_minor"
        stage_payload "$payload" "$wheelhouse" "$setup"
    fi

    # 1. Root file system, with the agent installed by the shared installer.
    run rm -rf "$rootfs"
    local hook
    hook=$(printf 'mkdir -p "$1/tmp/ncm-payload" && cp -a %q/. "$1/tmp/ncm-payload/" && chroot "$1" /bin/bash /tmp/ncm-payload/install-agent --payload /tmp/ncm-payload --boot-dir /boot/efi && rm -rf "$1/tmp/ncm-payload"' "$payload")
    local mm=(mmdebstrap --variant=apt --architectures="$arch" --include="$packages"
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*'
        --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*'
        --dpkgopt='path-include=/usr/share/locale/locale.alias'
        --customize-hook="$hook" "$suite" "$rootfs")
    [ -z "$mirror" ] || mm+=("$mirror")
    log "bootstrapping Debian $suite ($arch)"
    run "${mm[@]}"

    # 2. Appliance settings of this profile.
    local root_uuid esp_uuid
    root_uuid=$(cat /proc/sys/kernel/random/uuid)
    esp_uuid=$(cat /proc/sys/kernel/random/uuid)
    if [ "$DRY_RUN" = yes ]; then
        log "would write fstab, hostname, network and boot settings into $rootfs"
    elif [ "$rootfs_only" = yes ]; then
        finish_rootfs "$rootfs" "$root_uuid" "$esp_uuid" "$root_type" "$authorized_keys"
        rm -f "$rootfs/boot/efi/ncm-setup.txt"
        rm -rf "$out/rootfs-$arch"
        mv "$rootfs" "$out/rootfs-$arch"
        log "done in $((SECONDS - started)) s: $out/rootfs-$arch"
        return 0
    else
        stage_esp "$rootfs" "$esp" "$efi_name" "$root_uuid" "$console"
        finish_rootfs "$rootfs" "$root_uuid" "$esp_uuid" "$root_type" "$authorized_keys"
    fi

    # 3. The disk image.
    log "writing $img"
    run rm -f "$img"
    if [ "$DRY_RUN" = yes ]; then
        log "would make the file systems (mkfs.fat + mcopy, mkfs.ext4 -d) and lay them out with systemd-repart:"
        log "  ESP $esp_size (vfat) + $root_type $root_size (ext4), no Minimize="
    else
        make_filesystems "$build" "$esp" "$esp_size" "$rootfs" "$root_size"
        write_repart_definitions "$build/repart.d" "$build/esp.vfat" "$esp_uuid" "$esp_size" \
            "$build/root.ext4" "$root_uuid" "$root_type" "$root_size"
        systemd-repart --empty=create --size=auto --dry-run=no --no-pager \
            --definitions="$build/repart.d" "$img" >"$build/repart.log" 2>&1 \
            || { cat "$build/repart.log" >&2; die "systemd-repart failed"; }
        rm -rf "$esp" "$build/esp.vfat" "$build/root.ext4"
        fallocate --dig-holes "$img" 2>/dev/null || true  # sparse: unused space takes no room
        [ "$keep_rootfs" = yes ] && { rm -rf "$out/rootfs-$arch"; mv "$rootfs" "$out/rootfs-$arch"; } || rm -rf "$rootfs"
        if [ "$xz" = yes ]; then
            log "compressing"
            xz -T0 -3 -k -f "$img"
        fi
        (cd "$out" && sha256sum "$(basename "$img")" >"$(basename "$img").sha256")
        log "done in $((SECONDS - started)) s: $img ($(du -h --apparent-size "$img" | cut -f1), $(du -h "$img" | cut -f1) used)"
    fi
}

finish_rootfs() {
    local root="$1" root_uuid="$2" esp_uuid="$3" root_type="$4" keys="$5"
    echo ncm >"$root/etc/hostname"
    printf '127.0.0.1\tlocalhost\n127.0.1.1\tncm\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
    cat >"$root/etc/fstab" <<EOF
# ncm appliance. The root file system grows to fill the card on first boot.
PARTUUID=$root_uuid  /          ext4  defaults,noatime,x-systemd.growfs  0 1
PARTUUID=$esp_uuid   /boot/efi  vfat  umask=0077,noatime,nofail          0 2
EOF
    mkdir -p "$root/boot/efi"
    # systemd-repart at boot: grow the root partition to the size of the card.
    mkdir -p "$root/usr/lib/repart.d"
    printf '[Partition]\nType=%s\n' "$root_type" >"$root/usr/lib/repart.d/50-ncm-root.conf"
    ln -sf ../run/systemd/resolve/stub-resolv.conf "$root/etc/resolv.conf"
    install -m 0755 "$IMAGE_DIR/profiles/debian-generic/zz-ncm-esp" "$root/etc/kernel/postinst.d/zz-ncm-esp"
    mkdir -p "$root/etc/initramfs/post-update.d"
    install -m 0755 "$IMAGE_DIR/profiles/debian-generic/zz-ncm-esp" "$root/etc/initramfs/post-update.d/zz-ncm-esp"
    systemctl --root="$root" enable systemd-networkd.service systemd-resolved.service systemd-timesyncd.service \
        systemd-networkd-wait-online.service >/dev/null 2>&1
    # A headless appliance must not stop at an interactive first-boot prompt.
    systemctl --root="$root" mask systemd-firstboot.service >/dev/null 2>&1
    if [ -n "$keys" ]; then
        install -d -m 0700 "$root/root/.ssh"
        install -m 0600 "$keys" "$root/root/.ssh/authorized_keys"
    fi
    rm -f "$root"/etc/ssh/ssh_host_*  # regenerated per device (openssh's own unit does it)
    rm -rf "$root/var/cache/apt/archives/"*.deb "$root/var/lib/apt/lists/"*_Packages 2>/dev/null || true
}

stage_esp() {
    local root="$1" esp="$2" efi_name="$3" root_uuid="$4" console="$5" kernel initrd stub
    kernel=$(find "$root/boot" -maxdepth 1 -name 'vmlinuz-*' | sort -V | tail -n 1)
    initrd=$(find "$root/boot" -maxdepth 1 -name 'initrd.img-*' | sort -V | tail -n 1)
    stub=$(find "$root/usr/lib/systemd/boot/efi" -maxdepth 1 -name 'systemd-boot*.efi' | head -n 1)
    [ -n "$kernel" ] && [ -n "$initrd" ] || die "no kernel or initrd in $root/boot"
    [ -n "$stub" ] || die "systemd-boot is missing from the root file system"
    rm -rf "$esp"
    mkdir -p "$esp/EFI/BOOT" "$esp/EFI/systemd" "$esp/loader/entries"
    cp "$stub" "$esp/EFI/BOOT/$efi_name"
    cp "$stub" "$esp/EFI/systemd/"
    cp "$kernel" "$esp/vmlinuz"
    cp "$initrd" "$esp/initrd.img"
    printf 'default ncm.conf\ntimeout 2\nconsole-mode keep\neditor yes\n' >"$esp/loader/loader.conf"
    cat >"$esp/loader/entries/ncm.conf" <<EOF
title   ncm appliance (Debian)
linux   /vmlinuz
initrd  /initrd.img
options root=PARTUUID=$root_uuid rw rootwait console=tty0 console=$console,115200
EOF
    # The file a person edits from any computer before the first boot: the installer put
    # it into the ESP's mount point, where it would be hidden; it belongs on the ESP.
    [ -f "$root/boot/efi/ncm-setup.txt" ] || die "the installer wrote no ncm-setup.txt"
    mv "$root/boot/efi/ncm-setup.txt" "$esp/ncm-setup.txt"
}

# make_filesystems BUILD ESP_DIR ESP_SIZE ROOT_DIR ROOT_SIZE: the two file systems as
# plain files, filled without mounting anything (mtools for FAT, mkfs.ext4 -d for ext4),
# so the build needs neither loop devices nor a vfat driver on the host.
make_filesystems() {
    local build="$1" esp="$2" esp_size="$3" root="$4" root_size="$5"
    rm -f "$build/esp.vfat" "$build/root.ext4"
    truncate -s "$esp_size" "$build/esp.vfat"
    mkfs.fat -F 32 -n NCMBOOT "$build/esp.vfat" >/dev/null
    (cd "$esp" && mcopy -s -Q -i "$build/esp.vfat" ./* ::/)
    truncate -s "$root_size" "$build/root.ext4"
    mkfs.ext4 -q -F -L ncm-root -E root_owner=0:0 -d "$root" "$build/root.ext4"
}

write_repart_definitions() {
    local dir="$1" esp_image="$2" esp_uuid="$3" esp_size="$4" root_image="$5" root_uuid="$6" root_type="$7" root_size="$8"
    rm -rf "$dir"
    mkdir -p "$dir"
    # Explicit, equal minimum and maximum sizes: systemd 252 silently truncates with
    # Minimize=, so nothing is left to guessing. The file systems are made beforehand
    # (make_filesystems) and copied block by block.
    cat >"$dir/10-esp.conf" <<EOF
[Partition]
Type=esp
Label=NCMBOOT
UUID=$esp_uuid
CopyBlocks=$esp_image
SizeMinBytes=$esp_size
SizeMaxBytes=$esp_size
EOF
    cat >"$dir/20-root.conf" <<EOF
[Partition]
Type=$root_type
Label=ncm-root
UUID=$root_uuid
CopyBlocks=$root_image
SizeMinBytes=$root_size
SizeMaxBytes=$root_size
EOF
}
