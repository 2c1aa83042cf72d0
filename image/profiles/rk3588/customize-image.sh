#!/bin/bash
# ncm: Armbian userpatches/customize-image.sh, staged by `image/build rk3588`.
#
# Armbian's build runs this inside the chroot of the image it is making, with
# userpatches/overlay mounted at /tmp/overlay, as
#   customize-image.sh RELEASE LINUXFAMILY BOARD BUILD_DESKTOP ARCH
# It installs the ncm agent with the project's shared installer (payload staged in
# userpatches/overlay/ncm) and the RKNN runtime when one was supplied.
set -euo pipefail

RELEASE=${1:-}
LINUXFAMILY=${2:-}
BOARD=${3:-}
payload=${NCM_PAYLOAD:-/tmp/overlay/ncm}

echo "ncm: customizing Armbian $RELEASE for $BOARD ($LINUXFAMILY)"
[ -x "$payload/install-agent" ] || { echo "ncm: $payload/install-agent is missing" >&2; exit 1; }

if ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends python3 python3-venv
fi

bash "$payload/install-agent" --payload "$payload" --boot-dir /boot

# RKNN runtime library (librknnrt.so from Rockchip's rknpu2 releases), if supplied: the
# rknn-toolkit-lite2 wheel installed above loads it to reach the NPU.
if [ -f "$payload/rknn/librknnrt.so" ]; then
    install -m 0644 "$payload/rknn/librknnrt.so" /usr/lib/librknnrt.so
    ldconfig
    echo "ncm: installed librknnrt.so"
fi

# The RKNN converter (image/build rk3588 --rknn-converter): rknn-toolkit2 in an environment of
# its own (it pins old numpy, onnx and protobuf), which the agent runs to convert fragments.
if [ -d "$payload/rknn-converter" ]; then
    converter=/opt/ncm-rknn
    wheels="$payload/rknn-converter"
    pip=("$converter/bin/python" -m pip --disable-pip-version-check --no-cache-dir --no-input)
    rm -rf "$converter"
    python3 -m venv "$converter"
    PIP_CONFIG_FILE=/dev/null "${pip[@]}" install --quiet --no-index --find-links "$wheels" --no-deps \
        "$(grep -E '^rknn-toolkit2==' "$wheels/rknn-converter.txt")"
    PIP_CONFIG_FILE=/dev/null "${pip[@]}" install --quiet --no-index --find-links "$wheels" \
        -r <(grep -vE '^(#|rknn-toolkit2==|$)' "$wheels/rknn-converter.txt") torch 2>&1 \
        | grep -v "rknn-toolkit2 .* requires \|dependency resolver does not currently" || true
    "$converter/bin/python" -c 'from rknn.api import RKNN' >/dev/null \
        || { echo "ncm: the RKNN converter does not import in $converter" >&2; exit 1; }
    mkdir -p /etc/systemd/system/ncm-agent.service.d
    printf '[Service]\nEnvironment=NCM_RKNN_PYTHON=%s/bin/python\n' "$converter" \
        > /etc/systemd/system/ncm-agent.service.d/rknn-converter.conf
    echo "ncm: installed the RKNN converter in $converter"
fi
