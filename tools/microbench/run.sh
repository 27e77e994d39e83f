#!/usr/bin/env bash
# Kernel-level microbenchmarks of the C core (no Python), for tuning:
#   tools/microbench/run.sh peak                 FP32 FMA peak of each core
#   tools/microbench/run.sh tiles D [2]          tile kernels on one tile (2: AVX2)
#   tools/microbench/run.sh forward L D T H [c]  the whole forward pass (BWD=1: backward;
#                                                AB=1: AMX tiles against FMAs, one process)
#   tools/microbench/run.sh tile-decode D NQ [kind]  the decoding tile (kind 0/1/2/3: f32/f16/bf16/int8)
#   tools/microbench/run.sh decode Hk G Lk D T   decoding (G query rows a KV head), GB/s (INT8=1: int8, BF16=1: bfloat16; MEDIUM=1)
#   tools/microbench/run.sh read BYTES T         read bandwidth of T threads (the roofline;
#                                                CFLAGS="-DFMAS=n": n FMAs on every line read)
# CFLAGS passes -D options through (e.g. CFLAGS="-DNT=32" or "-DATTNX_BK=64").
# The user-facing numbers come from `python -m attnx bench`; these isolate
# one part at a time with min-of-many timing, which survives a noisy machine
# better than medians do.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../../csrc" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
what=${1:-}; shift || true
# the core's sources: the one list every build reads
mapfile -t core < <(grep -v '^#' "$src/sources.txt" | sed "s|^|$src/|")
case "$what" in
  peak)
    cc -O2 "$here/fma_peak.c" -o "$out/peak"
    pids=()
    for ((i = 0; i < $(nproc); i++)); do "$out/peak" & pids+=($!); done
    for p in "${pids[@]}"; do wait "$p"; done ;;  # a copy's failure fails the run
  tiles)
    cc -O3 -std=c11 ${CFLAGS:-} -I"$src" "${core[@]}" "$here/tile_kernels.c" -o "$out/tiles" -lm -lpthread
    "$out/tiles" "$@" ;;
  tile-decode)
    cc -O3 -std=c11 ${CFLAGS:-} -I"$src" "${core[@]}" "$here/decode_tile.c" -o "$out/tile" -lm -lpthread
    "$out/tile" "$@" ;;
  decode)
    cc -O3 -std=c11 ${CFLAGS:-} -I"$src" "${core[@]}" "$here/decode.c" -o "$out/decode" -lm -lpthread
    "$out/decode" "$@" ;;
  read)
    cc -O2 -std=c11 ${CFLAGS:-} "$here/read.c" -o "$out/read" -lpthread
    "$out/read" "$@" ;;
  forward)
    cc -O3 -std=c11 -DATTNX_TEST_HOOKS ${CFLAGS:-} -I"$src" "${core[@]}" "$here/forward.c" -o "$out/forward" -lm -lpthread
    "$out/forward" "$@" ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
