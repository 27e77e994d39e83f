#!/usr/bin/env bash
# Fuzz attnx's Python API with atheris under ASan+UBSan for a bounded time:
#   tools/fuzz.sh [SECONDS=60]
#
# Builds the sanitized copy of the tree (tools/sanitize.sh --build) and runs
# two harnesses one after the other, sharing SECONDS (half each):
#   tests/fuzz/fuzz_sdpa.py  scaled_dot_product_attention and its gradients,
#                            seeded with tests/fuzz/corpus/;
#   tests/fuzz/fuzz_api.py   the backward from saved tensors, merge_attention,
#                            varlen_attention(+vjp) and KVCache, seeded with
#                            tests/fuzz/corpus_api/.
# The C side is checked by the sanitizers (the extension is built with gcc,
# so libFuzzer gets coverage from the Python side only: atheris instruments
# the attnx package and the harnesses' decoders).
#
# An input that crashes (sanitizer report, signal, an exception of a kind the
# API does not document, a wrong result) is copied into its harness's corpus
# directory as crash-<sha1>, where tests/test_fuzz_corpus.py replays it under
# pytest from then on, and is printed (base64 and decoded) so it can be
# recovered from a CI log. Exits non-zero then (after running both harnesses).
#
# Environment: ATTNX_FUZZ_DIR (work directory, kept if given), ATTNX_FUZZ_FLAGS
# (more libFuzzer flags, e.g. -seed=1), ATTNX_FUZZ_ONLY (sdpa or api: run that
# harness alone, for all of SECONDS).
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-60}

python -c "import atheris" 2>/dev/null || { echo "fuzz: atheris is not installed (pip install atheris)" >&2; exit 1; }

if [[ -n "${ATTNX_FUZZ_DIR:-}" ]]; then
    work=$ATTNX_FUZZ_DIR
    mkdir -p "$work"
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/attnx-fuzz.XXXXXX")
    trap 'rm -rf "$work"' EXIT
fi

mapfile -t built < <(ATTNX_SANITIZE_DIR="$work/san" "$src/tools/sanitize.sh" --build | tail -n 6)
tree=${built[0]} preload=${built[1]} asan_opts=${built[2]} ubsan_opts=${built[3]} PY=${built[5]}
# The fuzzer needs sanitizer reports on stderr and its own death callback
# (which writes the crashing input): drop log_path, keep the rest. The ASan
# runtime cannot be first in the preload list (see below): allow that.
asan_opts="${asan_opts%%:log_path=*}:verify_asan_link_order=0:quarantine_size_mb=64"
ubsan_opts=${ubsan_opts%%:log_path=*}

# Python coverage for atheris' libFuzzer despite gcc's libasan (see the comment
# in tools/fuzz_preload.c): a small library preloaded before the ASan runtime.
libfuzzer=$("$PY" -c "import atheris, glob, os; print(glob.glob(os.path.join(os.path.dirname(atheris.__file__), 'core_with_libfuzzer*.so'))[0])")
${CC:-gcc} -O2 -fPIC -shared -o "$work/fuzz_preload.so" "$src/tools/fuzz_preload.c" -ldl

case "${ATTNX_FUZZ_ONLY:-}" in
    "") harnesses=(sdpa api) ;;
    sdpa|api) harnesses=("$ATTNX_FUZZ_ONLY") ;;
    *) echo "fuzz: ATTNX_FUZZ_ONLY must be sdpa or api, not '$ATTNX_FUZZ_ONLY'" >&2; exit 2 ;;
esac
# the seconds shared out (the first harness gets the odd one; at least 1 s each)
share=$(( secs / ${#harnesses[@]} ))
(( share >= 1 )) || share=1

san_env=(env LD_PRELOAD="$work/fuzz_preload.so:$preload" ATTNX_FUZZ_LIBFUZZER="$libfuzzer"
         ASAN_OPTIONS="$asan_opts" UBSAN_OPTIONS="$ubsan_opts" PYTHONPATH="$tree"
         PYTHONDONTWRITEBYTECODE=1)

failed=0
for h in "${harnesses[@]}"; do
    case $h in
        sdpa) script=tests/fuzz/fuzz_sdpa.py corpus=corpus max_len=512
              what="scaled_dot_product_attention" ;;
        api)  script=tests/fuzz/fuzz_api.py corpus=corpus_api max_len=1024
              what="the backward, merge_attention, varlen_attention, KVCache" ;;
    esac
    t=$share
    [[ $h == "${harnesses[0]}" ]] && t=$(( share + secs - share * ${#harnesses[@]} ))
    (( t >= 1 )) || t=1
    dir=$work/$h
    rm -rf "$dir"
    mkdir -p "$dir/corpus" "$dir/artifacts"
    cp "$src/tests/fuzz/$corpus"/* "$dir/corpus/" 2>/dev/null || true

    echo "== fuzzing $what ($script) for $t s under ASan+UBSan"
    rc=0
    (cd "$tree" && "${san_env[@]}" "$PY" "$script" "$dir/corpus" \
        -max_total_time="$t" -timeout=60 -rss_limit_mb=6144 -max_len="$max_len" \
        -artifact_prefix="$dir/artifacts/" -print_final_stats=1 ${ATTNX_FUZZ_FLAGS:-} \
        ) >"$dir/fuzz.log" 2>&1 || rc=$?
    grep -E '^(#[0-9]+[[:space:]]+(DONE|INITED)|stat::|Done |INFO: seed corpus)' "$dir/fuzz.log" || true

    shopt -s nullglob
    found=("$dir"/artifacts/*)
    if [[ $rc -ne 0 || ${#found[@]} -gt 0 ]]; then
        failed=1
        echo "fuzz: $script stopped with exit code $rc; its log ends:" >&2
        tail -n 80 "$dir/fuzz.log" >&2
        mkdir -p "$src/tests/fuzz/$corpus"
        for f in "${found[@]}"; do
            name=$(basename "$f")
            cp "$f" "$src/tests/fuzz/$corpus/$name"
            echo "fuzz: kept $name in tests/fuzz/$corpus/ (base64: $(base64 -w0 "$f"))" >&2
            # fuzz_api.py's --describe runs the input (its reads follow the calls):
            # in the fuzzer's environment, so that the sanitized attnx imports
            (cd "$tree" && "${san_env[@]}" "$PY" "$script" --describe "$f") >&2 || true
        done
    else
        echo "fuzz: no crash in $t s ($script)"
    fi
done
exit $failed
