#!/usr/bin/env bash
# Build the core with no Python and run its plain C test: tests/c/run.sh [cc] [cases] [runner]
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
cc=${1:-cc}
out=$(mktemp -d)
mapfile -t core < <(grep -v '^#' "$here/csrc/sources.txt" | sed "s|^|$here/csrc/|")
$cc -std=c11 -O2 -Wall -Wextra -Wno-unused-parameter ${CFLAGS:-} -I"$here/csrc" \
    "${core[@]}" "$here"/tests/c/test_core.c -o "$out/test_core" -lm -lpthread ${LDFLAGS:-}
${3:-} "$out/test_core" "${2:-300}"
