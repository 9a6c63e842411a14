#!/usr/bin/env bash
# Builds the emulated CUDA driver and cuBLAS (driver.cpp, cublas.cpp) into the folder given
# (default target/cuda_emu) as libcuda.so.1 and libcublas.so.13, for GEMS_CUDA_LIB_DIRS.
# EMU_SANITIZE=address builds them with AddressSanitizer (then LD_PRELOAD its runtime).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here/../../target/cuda_emu}"
mkdir -p "$out"
flags=(-std=c++20 -O2 -ffp-contract=off -fPIC -shared -I"$here/../../include" -include "$here/emu.h")
[[ -n "${EMU_SANITIZE:-}" ]] && flags+=(-fsanitize="$EMU_SANITIZE" -fno-omit-frame-pointer)
# Every kernel, by name, from the sources as the preprocessor stamps them.
cat "$here"/../../cuda/*.cu | g++ "${flags[@]}" -E -P -x c++ - 2>/dev/null \
    | grep -oE 'extern "C" +void +[A-Za-z0-9_]+ *\(' | sed -E 's/.*void +([A-Za-z0-9_]+).*/GEMS_KERNEL(\1)/' \
    | grep -v 'GEMS_KERNEL(__' | sort -u >"$out/kernels.inc"
g++ "${flags[@]}" -I"$out" -Wl,-soname,libcuda.so.1 -o "$out/libcuda.so.1" "$here/driver.cpp" -lpthread
g++ -std=c++20 -O2 -fPIC -shared -Wl,-soname,libcublas.so.13 -o "$out/libcublas.so.13" "$here/cublas.cpp"
echo "$(wc -l <"$out/kernels.inc") kernels in $out/libcuda.so.1"
