#!/usr/bin/env bash
# Pack a Triton release from PyPI to carry to the GPU machine, whose image has Triton 3.6, Python
# 3.12 and no network, so the kernels can be timed under the Triton that newer PyTorch releases
# bring (torch 2.14 asks for 3.8; CI's CPU Triton is 3.9). From the repository root:
#
#   bash benchmarks/carry_triton.sh 3.9.0     # -> .carry/triton-3.9.0.tar.xz, about 41 MB
#
# The device tool carries at most 64 MiB with the working tree, and the wheel is about 280 MB, so
# only what Hopper needs is kept: the Python package, the NVIDIA backend's sources, headers and
# libdevice, and libtriton.so without its debug information (500 MB to 184 MB, 40 MB packed). Left
# out: the AMD backend (the run sets TRITON_BACKENDS_IN_TREE=1, so the image's installed 3.6
# entry points, which name it, are not read), the profiler library, and the CUDA binaries;
# gpu_session.sh points both of Triton's ptxas settings at the image's CUDA ptxas. That is not
# always the ptxas the wheel brings for sm_90 (Triton 3.9 uses its CUDA 13.4 one, the image has
# 13.0; offline, Triton 3.9 with 13.0 gave the backward's loops 3-4 instructions more a step).
# Then: `WITH_TRITON=.carry/triton-3.9.0.tar.xz bash benchmarks/gpu_session.sh STAGE`, or the
# stage `triton-versions`, with `.carry` named in the device call's carry.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: carry_triton.sh VERSION (a Triton release on PyPI, e.g. 3.9.0)}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$work" "triton==$version"
wheel=$(ls "$work"/triton-*.whl)
mkdir "$work/site"
python -m zipfile -e "$wheel" "$work/site"
pkg="$work/site/triton"
rm -rf "$pkg/backends/amd" "$pkg/backends/nvidia/bin" "$pkg/backends/nvidia/lib"/cupti* "$pkg/_C"/libproton*
strip --strip-unneeded "$pkg/_C/libtriton.so"
mkdir -p .carry
tar -C "$work/site" -cf - triton | xz -T0 -9 > ".carry/triton-$version.tar.xz"
size=$(du -m ".carry/triton-$version.tar.xz" | cut -f1)
echo "packed Triton $version for Python 3.12 into .carry/triton-$version.tar.xz (${size} MB)"
[ "$size" -lt 60 ] || echo "warning: ${size} MB leaves little of the device call's 64 MiB carry" >&2
