#!/usr/bin/env bash
# Run HERE (this machine reaches the package registries; the GPU machine reaches nothing):
# builds nxd's wheels and downloads the third-party wheels that the GPU machine's image lacks,
# for its Python (3.12, x86-64), into bench/gpu/.wheels/ (git-ignored; the device call carries it).
#
#     bash bench/gpu/prepare.sh
#
# The image already holds torch 2.11, transformers 5.17, tokenizers, safetensors, tqdm, numpy and
# protobuf (/work/.library/device/KINDS.md); nxd needs three more: tensorboardX (nxd-train's event
# files), isal (nxd-ckpt's CRC-32) and tomli-w (nxd-train's config.toml); filelock is there. Versions are uv.lock's.
set -euo pipefail
cd "$(dirname "$0")/../.."
W=bench/gpu/.wheels
PY=3.12
THIRD_PARTY=(tensorboardX==2.6.5 isal==1.9.1 tomli-w==1.2.0)

rm -rf "$W"
mkdir -p "$W"
# nxd's packages (pure Python, one wheel each) as users get them: no workspace sources.
uv build --all-packages --no-sources --wheel --out-dir "$W" -q
rm -f "$W"/.gitignore "$W"/*.tar.gz
# Third-party wheels for CPython $PY on x86-64 Linux, no dependencies (those are in the image).
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
    --implementation cp "${platforms[@]}" -d "$W" "${THIRD_PARTY[@]}"
ls -l "$W"
size=$(du -sm "$W" | cut -f1)
echo "prepare.sh: $(ls "$W"/*.whl | wc -l) wheels, ${size} MiB in $W (the device call's limit is 64 MiB for everything)"
