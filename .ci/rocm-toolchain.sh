#!/usr/bin/env bash
# What the FlyDSL compile-only checks (tests/kernels/test_flydsl_isa.py) need on a
# CPU-only Linux box: FlyDSL from PyPI (the `rocm` extra) in the active virtual
# environment, and an AMDGPU-capable ld.lld that FlyDSL finds at
# $ROCM_PATH/llvm/bin/ld.lld. No ROCm install and no GPU are needed.
#
# Run from the repository root with the virtual environment active:
#     bash .ci/rocm-toolchain.sh
# It prints the ROCM_PATH it prepared; the tests find that directory by
# themselves (MOEGEMM_CACHE_DIR, default ~/.cache/moegemm, /rocm).
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install -q -e '.[rocm]'

if ! command -v ld.lld-19 >/dev/null 2>&1 && ! command -v ld.lld >/dev/null 2>&1; then
    # Debian's lld-19 links AMDGPU code objects.
    if [ "$(id -u)" -eq 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq lld-19 >/dev/null
    else
        sudo apt-get update -qq
        sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq lld-19 >/dev/null
    fi
fi
lld="$(command -v ld.lld-19 || command -v ld.lld)"

rocm_path="${MOEGEMM_CACHE_DIR:-$HOME/.cache/moegemm}/rocm"
mkdir -p "$rocm_path/llvm/bin"
ln -sf "$lld" "$rocm_path/llvm/bin/ld.lld"
"$rocm_path/llvm/bin/ld.lld" --version
python -c "import importlib.metadata as m; print('flydsl', m.version('flydsl'))"
echo "ROCM_PATH=$rocm_path"
