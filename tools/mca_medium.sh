#!/usr/bin/env bash
# The hot loops of precision "medium"'s kernels (vdpbf16ps: avx512_bf16.c,
# medium_rows_avx512.h; AMX tiles: amx.c) through LLVM's machine-code
# analyzer, on a CPU that has neither (issue 60; docs/medium_model.md):
#   1. the kernel files compiled to assembly as setup.py compiles them (Python's
#      CFLAGS less -g, -fPIC, setup.py's flags), each into a TU of its own that
#      includes the file and adds a few wrappers: decoding's blocks with the row
#      kind fixed (in the library the kind is a run-time argument, and the loop
#      holds all three kinds' code), and the tile blocks with their full shape;
#   2. from each function named below, the innermost loop with the most
#      vdpbf16ps (or tdpbf16ps): the path from its head label to its back edge
#      with conditional jumps not taken, which for these loops is the path an
#      iteration takes (the prefetch every 16 pairs of qk_bf16 and the exits
#      are laid out off it; the wrappers fold decoding's other branches away);
#   3. llvm-mca on it for znver4 and sapphirerapids: cycles an iteration,
#      the most loaded resource, the bottleneck analysis's verdict, and the
#      loop's vdpbf16ps alone in the same model (the ceiling: the model's own
#      vdpbf16ps rate for the forms the compiler chose).
# llvm-mca 19 has no model of the AMX tile instructions (it gives them one uop,
# latency 100), so for the tile loops it models the rest of the loop only, next
# to the tile unit's nominal time: 16 cycles a TDPBF16PS (1024 flops/cycle) and,
# an assumption, 8 cycles a TILELOADD (16 rows of 64 bytes on two load ports).
#
#   tools/mca_medium.sh                 gcc (setup.py's compiler here) and clang-19
#   MCA_CC="clang-19" tools/mca_medium.sh
#   MCA_OUT=DIR                         keep the assembly, the loops and the reports there
# Needs llvm-mca-19 (and clang-19 for the clang rows): Debian's llvm-19 and clang-19.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
mca=${MCA_BIN:-llvm-mca-19}
command -v "$mca" >/dev/null || { echo "mca_medium: no $mca (apt-get install llvm-19)" >&2; exit 1; }
out=${MCA_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/attnx-mca.XXXXXX")}
mkdir -p "$out"
py_cflags=$(python3 -c 'import sysconfig as s; print(s.get_config_var("CFLAGS") or "")' | sed 's/\(^\| \)-g\( \|$\)/ /')
flags="$py_cflags -fPIC -std=c11 -O3 -fno-math-errno -Wall -Wextra -Wno-unused-parameter
       -fvisibility=hidden -DNPY_NO_DEPRECATED_API=NPY_1_23_API_VERSION -I$src/csrc"

# the wrappers (compiled only here): a block's loop with its shape and row kind constant
cat >"$out/bf16_tu.c" <<'EOF'
#include "kernels/avx512_bf16.c"
#define MCA_FN __attribute__((noinline, used, target("avx512f,avx512vl,avx512bw,avx512bf16")))
#define QK_DOT(name, kind)                                                                   \
    MCA_FN void mca_qk_dot_##name(const uint32_t *qp, int64_t ldp, const char *k, int64_t row, \
                                  int64_t D, const float *f, float *st, int64_t ldk)           \
    {                                                                                        \
        qk_dot_medium_block(4, 4, kind, qp, ldp, k, row, D, f, st, ldk);                     \
    }
/* a whole tile of keys (nk = ATTNX_BK, even): the loop without the branch for a
 * last odd key, which would otherwise cut the loop's text in two */
#define PV_ROWS(name, kind)                                                                      \
    MCA_FN void mca_pv_rows_##name(const uint32_t *pp, const char *v, int64_t row,               \
                                   const float *alpha, float *acc, int64_t ldacc, int64_t ahead) \
    {                                                                                            \
        pv_rows_medium_block(4, 2, kind, pp, v, row, ATTNX_BK, alpha, acc, ldacc, ahead);        \
    }
QK_DOT(bf16, ATTNX_MEDIUM_BF16) QK_DOT(f16, ATTNX_MEDIUM_F16) QK_DOT(i8, ATTNX_MEDIUM_I8)
PV_ROWS(bf16, ATTNX_MEDIUM_BF16) PV_ROWS(f16, ATTNX_MEDIUM_F16) PV_ROWS(i8, ATTNX_MEDIUM_I8)
EOF
cat >"$out/amx_tu.c" <<'EOF'
#include "kernels/amx.c"
#define MCA_FN __attribute__((noinline, used, flatten,                                \
                              target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
MCA_FN void mca_amx_qk(const uint32_t *qt2, int64_t ldq, const uint16_t *k, int64_t k_sl,
                       int64_t D, float scale, float *st)
{
    block(2, 2, qt2, ldq, k, k_sl, D, scale, st);
}
MCA_FN void mca_amx_pv(const uint16_t *vt, int64_t ldv, const uint32_t *parts, int steps,
                       float *acct, int64_t ldq)
{
    pv_block(2, 2, vt, ldv, 0, 1, 1, parts, steps, acct, ldq); /* pv_medium's: P rounded once */
}
MCA_FN void mca_amx_ptx(const uint16_t *pp, int64_t ldp, int nq, const uint32_t *xp, int64_t ldx,
                        float *acc, int64_t ldacc)
{
    ptx_block(2, 2, pp, ldp, nq, xp, ldx, acc, ldacc);
}
EOF

IFS=' ' read -r -a ccs <<<"${MCA_CC:-gcc clang-19}"
for cc in "${ccs[@]}"; do
    command -v "$cc" >/dev/null || { echo "mca_medium: no $cc" >&2; exit 1; }
    # shellcheck disable=SC2086
    for tu in bf16_tu amx_tu; do
        $cc $flags -S "$out/$tu.c" -o "$out/$tu.$cc.s"
    done
done

MCA="$mca" OUT="$out" CCS="${ccs[*]}" python3 - <<'EOF'
import os, re, subprocess

mca, out, ccs = os.environ["MCA"], os.environ["OUT"], os.environ["CCS"].split()
ITER = 500
GHZ = {"znver4": 3.7, "sapphirerapids": 3.5}
TILE_OPS = ("tdpbf16ps", "tileloadd", "tileloaddt1", "tilestored", "tilezero")

# name, TU, function, key instruction, flops of a tile, the tile. An iteration's
# flops are counted from its key instructions (64 a vdpbf16ps, 16384 a
# tdpbf16ps), so that a loop the compiler unrolled is measured right.
FLOPS = {"vdpbf16ps": 64, "tdpbf16ps": 16 * 16 * 32 * 2}
LOOPS = [
    ("qk_bf16 8x2", "bf16_tu", "attnx_qk_bf16_avx512", "vdpbf16ps", 8 * 32 * 128 * 2,
     "8 keys x 32 queries x D=128"),
    ("pv_medium 4x4", "bf16_tu", "attnx_pv_medium_avx512", "vdpbf16ps", 4 * 64 * 128 * 2,
     "4 dims x 64 queries x 128 keys"),
    ("ptx_medium 4x4", "bf16_tu", "attnx_ptx_medium_avx512", "vdpbf16ps", 4 * 64 * 64 * 2,
     "4 keys x 64 dims x 64 queries"),
    ("qk_dot_medium 4x4 bf16", "bf16_tu", "mca_qk_dot_bf16", "vdpbf16ps", 4 * 4 * 128 * 2,
     "4 queries x 4 keys x D=128"),
    ("qk_dot_medium 4x4 f16", "bf16_tu", "mca_qk_dot_f16", "vdpbf16ps", 4 * 4 * 128 * 2, "as bf16"),
    ("qk_dot_medium 4x4 i8", "bf16_tu", "mca_qk_dot_i8", "vdpbf16ps", 4 * 4 * 128 * 2, "as bf16"),
    ("pv_rows_medium 4x2 bf16", "bf16_tu", "mca_pv_rows_bf16", "vdpbf16ps", 4 * 64 * 128 * 2,
     "4 rows x 64 dims x 128 keys"),
    ("pv_rows_medium 4x2 f16", "bf16_tu", "mca_pv_rows_f16", "vdpbf16ps", 4 * 64 * 128 * 2, "as bf16"),
    ("pv_rows_medium 4x2 i8", "bf16_tu", "mca_pv_rows_i8", "vdpbf16ps", 4 * 64 * 128 * 2, "as bf16"),
    ("AMX qk_bf16 block 2x2", "amx_tu", "mca_amx_qk", "tdpbf16ps", 32 * 32 * 128 * 2,
     "32 keys x 32 queries x D=128"),
    ("AMX pv_medium block 2x2", "amx_tu", "mca_amx_pv", "tdpbf16ps", 32 * 32 * 128 * 2,
     "32 dims x 32 queries x 128 keys"),
    ("AMX ptx_medium block 2x2", "amx_tu", "mca_amx_ptx", "tdpbf16ps", 32 * 32 * 64 * 2,
     "32 keys x 32 dims x 64 queries"),
]


def functions(path):
    """{name: [lines]} of the assembly's functions."""
    funcs, cur = {}, None
    for line in open(path):
        line = line.rstrip("\n")
        m = re.match(r"^([A-Za-z_$][\w.$]*):", line)
        if m:
            cur = m.group(1)
            funcs[cur] = []
        if cur is not None:
            funcs[cur].append(line)
        if line.strip().startswith(".size") and cur and re.search(r"\b%s\b" % re.escape(cur), line):
            cur = None
    return funcs


def is_insn(line):
    s = line.strip()
    return line[:1] == "\t" and s and not s.startswith((".", "#"))


def walk(lines, labels, head, edge):
    """The instructions run from the loop's head label (line `head`) to its back edge
    (line `edge`), conditional jumps not taken but the back edge; None if the path
    leaves the lines head..edge, jumps through a table, or passes another backward
    jump (an inner loop's: this loop is not innermost)."""
    body, pos = [], head
    while head <= pos <= edge and len(body) < 4000:
        line = lines[pos]
        if not is_insn(line):
            pos += 1
            continue
        insn = line.split("#")[0].rstrip()
        body.append(insn)
        m = re.match(r"\s+(j\w+)\s+(\S+)", insn)
        if m:
            target = labels.get(m.group(2))
            if target is None:
                if m.group(1) == "jmp":
                    return None  # out of the function, or through a table
            elif target == head:
                return body if pos == edge else None
            elif m.group(1) == "jmp":
                if target < pos or not head <= target <= edge:
                    return None
                pos = target
                continue
            elif head <= target < pos:
                return None  # an inner loop's back edge
        pos += 1
    return None


def loop(lines, key):
    """The innermost loop with the most `key`s (the fewest instructions among those):
    the path its iterations take (walk)."""
    labels = {m.group(1): i for i, l in enumerate(lines) for m in [re.match(r"^(\.L\w+):", l)] if m}
    best = None
    for i, l in enumerate(lines):
        m = re.match(r"^\s+j\w+\s+(\.L\w+)", l)
        if not m or labels.get(m.group(1), i) >= i:
            continue
        body = walk(lines, labels, labels[m.group(1)], i)
        if not body:
            continue
        n = sum(1 for b in body if re.match(r"\s+%s\b" % key, b))
        if n and (best is None or (n, -len(body)) > (best[0], -len(best[1]))):
            best = (n, body)
    return best


def run_mca(body, cpu, name):
    path = os.path.join(out, name + ".s")
    with open(path, "w") as f:
        f.write("\n".join(body) + "\n")
    rep = subprocess.run([mca, "-mcpu=" + cpu, "-iterations=%d" % ITER, "-bottleneck-analysis",
                          "-timeline=false", path], capture_output=True, text=True)
    if rep.returncode:
        raise SystemExit("llvm-mca on %s: %s" % (path, rep.stderr))
    with open(path[:-2] + ".mca.txt", "w") as f:
        f.write(rep.stdout)
    text = rep.stdout
    cycles = int(re.search(r"Total Cycles:\s+(\d+)", text).group(1)) / ITER
    # the most loaded resource
    res = re.findall(r"^\[(\d+(?:\.\d+)?)\]\s+-\s+(\S+)", text, re.M)
    m = re.search(r"Resource pressure per iteration:\n(.*)\n(.*)\n", text)
    top = ""
    if m:
        heads = re.findall(r"\[([\d.]+)\]", m.group(1))
        vals = m.group(2).split()
        names = dict(res)
        load = [(float(v), names.get(h, h)) for h, v in zip(heads, vals) if v != "-"]
        if load:
            v, n = max(load)
            same = sorted({nn for vv, nn in load if vv == v})
            top = "%s %.1f" % ("/".join(same), v)
    # the bottleneck analysis: how much of the time resources, and data dependencies, held it up
    rp = re.search(r"Resource Pressure\s+\[\s*([\d.]+)%", text)
    dd = re.search(r"Data Dependencies:\s+\[\s*([\d.]+)%", text)
    verdict = "pressure %s%%, dependencies %s%%" % (rp.group(1) if rp else "0", dd.group(1) if dd else "0")
    return cycles, top, verdict


def kinds(body):
    count = lambda pat: sum(1 for l in body if re.match(r"\s+(%s)" % pat, l))
    return {
        "insns": len(body),
        "spill": sum(1 for l in body if re.search(r"\(%rsp\)|\(%rbp\)", l)),
        "cvt": count(r"vcvt"),
        "shuf": count(r"vperm|vpunpck|vshuf|vextract|vinsert|valign|vpshuf"),
        "const": sum(1 for l in body if re.search(r"\.LC\d+\(%rip\)|\.LCPI\w*\(%rip\)", l)),
    }


rows = []
for cc in ccs:
    asm = {tu: functions(os.path.join(out, "%s.%s.s" % (tu, cc))) for tu in ("bf16_tu", "amx_tu")}
    for name, tu, fn, key, tile_flops, tile in LOOPS:
        if fn not in asm[tu]:
            raise SystemExit("mca_medium: no %s in %s.%s.s" % (fn, tu, cc))
        found = loop(asm[tu][fn], key)
        if not found:
            raise SystemExit("mca_medium: no loop with %s in %s (%s)" % (key, fn, cc))
        nkey, body = found
        flops = nkey * FLOPS[key]
        per_tile = tile_flops / flops
        tag = re.sub(r"\W+", "_", "%s_%s" % (name, cc))
        k = kinds(body)
        if key == "tdpbf16ps":
            ntl = sum(1 for l in body if re.match(r"\s+tileloadd", l))
            rest = [l for l in body if not re.match(r"\s+(%s)\b" % "|".join(TILE_OPS), l)]
            cyc, top, verdict = run_mca(rest, "sapphirerapids", tag + "_spr_rest")
            tile_c = 16 * nkey
            it = max(tile_c, 8 * ntl, cyc)
            rows.append((name, cc, "sapphirerapids", flops, it, it * per_tile, flops / it * GHZ["sapphirerapids"],
                         tile_c / it,
                         "tile unit %d (%d tdpbf16ps), tile loads %d (%d), the rest %.1f (%s)"
                         % (tile_c, nkey, 8 * ntl, ntl, cyc, top), k))
            continue
        for cpu in ("znver4", "sapphirerapids"):
            cyc, top, verdict = run_mca(body, cpu, "%s_%s" % (tag, cpu))
            ceil, _, _ = run_mca([l for l in body if re.match(r"\s+vdpbf16ps\b", l)], cpu,
                                 "%s_%s_vdpbf16ps" % (tag, cpu))
            rows.append((name, cc, cpu, flops, cyc, cyc * per_tile, flops / cyc * GHZ[cpu], ceil / cyc,
                         "%s; %s" % (top, verdict or "-"), k))

print("loop | cc | CPU | flops/iter | cycles/iter | cycles/tile | GFLOP/s/core | of ceiling | "
      "most loaded resource (cycles/iter); bottleneck analysis | insns, stack refs, cvt, shuffles, "
      "constant loads")
print("---|---|---|---|---|---|---|---|---|---")
for name, cc, cpu, flops, it, tile, gf, frac, why, k in rows:
    print("%s | %s | %s | %d | %.2f | %.0f | %.0f | %.0f%% | %s | %d, %d, %d, %d, %d"
          % (name, cc, cpu, flops, it, tile, gf, 100 * frac, why, k["insns"], k["spill"], k["cvt"],
             k["shuf"], k["const"]))
# the models' own rates: 12 independent instructions of a kind (zmm), cycles each
print("\nthe models' rates, cycles an instruction over 12 independent ones (zmm):")
probes = [("vdpbf16ps, registers", "vdpbf16ps %%zmm30, %%zmm31, %%zmm%d"),
          ("vdpbf16ps, {1to16} from memory", "vdpbf16ps (%%rax){1to16}, %%zmm31, %%zmm%d"),
          ("vfmadd231ps, registers", "vfmadd231ps %%zmm30, %%zmm31, %%zmm%d")]
for what, fmt in probes:
    rates = []
    for cpu in ("znver4", "sapphirerapids"):
        cyc, _, _ = run_mca([fmt % i for i in range(12)], cpu, "rate_%s_%s" % (what.split(",")[0], cpu))
        rates.append("%s %.2f" % (cpu, cyc / 12))
    print("  %-32s %s" % (what, ", ".join(rates)))
print("\ntiles:")
for name, _, _, _, tile_flops, tile in LOOPS:
    print("  %-26s %s (%d flops)" % (name, tile, tile_flops))
print("clocks assumed: znver4 %.1f GHz, sapphirerapids %.1f GHz; the loops and llvm-mca's reports: %s"
      % (GHZ["znver4"], GHZ["sapphirerapids"], out))
EOF
