/* Each instruction set's kernel table against the scalar table, kernel by
 * kernel, with no driver in between: every kernel of kernels.h over sizes
 * around every vector width (1 .. 2W+1 for W up to 16, and past the widest
 * register block), strides of both signs, and inputs at the edges (the exp
 * flush below -87.34, -inf, NaN, inf).
 *
 * Tolerances, per kernel:
 *   identical  (the same bits; NaN where the scalar kernel gives NaN): where
 *              both do the same float operations: mask_float, mask_bool,
 *              pack_qt, store_rows (and its inf/NaN flag), softmax_bwd,
 *              softcap_bwd, alibi; and
 *              qk, qk_dot, pv, ptx on small integers, whose products and
 *              sums are exact in float32 whatever the order or FMA
 *   summation  qk, qk_dot, pv, ptx on random floats: the SIMD kernels use
 *              FMA and their own order of summation; |a - b| <= (n + 2) ·
 *              2^-23 · sum of |terms| (n terms: the bound of recursive
 *              summation, for both)
 *   ulps       softmax_online, softmax_final: the SIMD exp evaluates the same
 *              polynomial with FMA (each within 1 ulp of exp): m identical;
 *              exp(s - m) and alpha within 2 ulp, the final probabilities
 *              exp(s - m) · inv_l within 3 ulp (and anything within 2^-149,
 *              for results near the flush); l within (nk + 4) · 2^-23 · l;
 *              softcap within 2 ulp of the scalar kernel (the exp's FMA), and
 *              attnx_tanhf within 3 ulp of the C library's tanh
 * Kernels must also leave alone what their contract does not let them write
 * (checked with guard values around the outputs).
 *
 *   tests/c/run.sh [cc]           (builds the core from csrc/sources.txt)
 *
 * Ends with the line "N passed, M failed"; exits 1 on any failure. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "core/platform.h"
#include "kernels/kernels.h"
#include "common.h"

#define LDQ ATTNX_BQ /* the drivers' ldq: a multiple of every vector width */
#define MAXW 16      /* the widest vector: sizes 1 .. 2 * MAXW + 1 */
#define SMAX (2 * MAXW + 1)
#define GUARD 12345.0f /* what a kernel must not overwrite */

static float irand_f(int lo, int hi) { return (float)(lo + (int)(urand() * (hi - lo + 1))); }

/* ---- bookkeeping: one line per instruction set and kernel ---------------- */

static int passed = 0, failed = 0;
static struct {
    const char *isa, *kernel, *tolerance;
    long cases, bad;
    double worst; /* of the tolerance used (0: identical) */
} cur;

static void begin(const char *isa, const char *kernel, const char *tolerance)
{
    cur.isa = isa;
    cur.kernel = kernel;
    cur.tolerance = tolerance;
    cur.cases = cur.bad = 0;
    cur.worst = 0.0;
}

static void end(void)
{
    printf("  %-7s %-15s %7ld cases  %-10s", cur.isa, cur.kernel, cur.cases, cur.tolerance);
    if (strcmp(cur.tolerance, "identical") != 0) printf(" worst %.3g of the bound", cur.worst);
    printf("%s\n", cur.bad ? "  FAILED" : "");
    if (cur.bad)
        failed++;
    else
        passed++;
}

/* Record one comparison; print the first few failures of a kernel. */
static int expect(int ok, const char *fmt, ...)
{
    if (ok) return 1;
    if (cur.bad++ < 5) {
        va_list ap;
        va_start(ap, fmt);
        printf("FAIL %s %s: ", cur.isa, cur.kernel);
        vprintf(fmt, ap);
        printf("\n");
        va_end(ap);
    }
    return 0;
}

static uint32_t bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static int same(float a, float b) { return (a != a && b != b) || bits(a) == bits(b); }

/* Distance in units in the last place (the floats in between, plus one). */
static double ulps(float a, float b)
{
    if (a != a || b != b) return (a != a && b != b) ? 0.0 : INFINITY;
    if (a == b) return 0.0;
    if (isinf(a) || isinf(b)) return INFINITY;
    const int64_t ia = (int32_t)bits(a) < 0 ? -(int64_t)(bits(a) & 0x7fffffffu) : bits(a);
    const int64_t ib = (int32_t)bits(b) < 0 ? -(int64_t)(bits(b) & 0x7fffffffu) : bits(b);
    return (double)(ia > ib ? ia - ib : ib - ia);
}

/* got == want bit for bit, at element (i, j) of the kernel's output. */
static int expect_same(float got, float want, const char *what, int i, int j)
{
    return expect(same(got, want), "%s[%d][%d] = %a, scalar %a", what, i, j, got, want);
}

/* |got - want| <= bound, with the fraction of the bound used tracked. */
static int expect_within(float got, float want, double bound, const char *what, int i, int j)
{
    if (got != got || want != want || isinf(got) || isinf(want))
        return expect_same(got, want, what, i, j);
    const double d = fabs((double)got - (double)want);
    const double used = bound > 0 ? d / bound : (d > 0 ? INFINITY : 0.0);
    if (used > cur.worst) cur.worst = used;
    return expect(d <= bound, "%s[%d][%d] = %a, scalar %a (bound %g)", what, i, j, got, want,
                  bound);
}

static int expect_ulps(float got, float want, double max_ulps, const char *what, int i, int j)
{
    if (fabs((double)got - (double)want) <= 0x1p-149) return 1; /* subnormal noise at the flush */
    const double u = ulps(got, want);
    if (u / max_ulps > cur.worst) cur.worst = u / max_ulps;
    return expect(u <= max_ulps, "%s[%d][%d] = %a, scalar %a (%g ulp)", what, i, j, got, want, u);
}

/* Buffers: n floats set to GUARD, or to random values. */
static float *guarded(size_t n)
{
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) x[i] = GUARD;
    return x;
}

/* Values: small integers (exact products and sums) or random floats. */
static void fill(float *x, size_t n, int exact)
{
    for (size_t i = 0; i < n; i++) x[i] = exact ? irand_f(-4, 4) : nrand();
}

/* A size loop: 1 .. 2W+1, then the sizes past the register blocks. */
static const int wide[] = {63, 64, 65, 127, 129};
#define NWIDE ((int)(sizeof wide / sizeof *wide))
static int size_at(int k) { return k < SMAX ? k + 1 : wide[k - SMAX]; }

/* Compare a tile of scores against the reference: (nk, LDQ), lanes i < nq
 * compared and lanes past round_up(nq, 16) untouched; or with rows set the
 * decoding tile (nq, LDQ), keys j < nk compared and the rest of each row
 * untouched. The line past the last is untouched either way. bound: (nk, LDQ). */
static void compare_tile(const float *got, const float *want, int nk, int nq, int rows, int exact,
                         const float *bound, const char *what)
{
    const int lines = rows ? nq : nk, written = rows ? nk : ATTNX_ROUND16(nq);
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i++) {
            const int at = rows ? i * LDQ + j : j * LDQ + i;
            if (exact)
                expect_same(got[at], want[at], what, j, i);
            else
                expect_within(got[at], want[at], bound[j * LDQ + i], what, j, i);
        }
    for (int x = 0; x < lines; x++)
        for (int y = written; y < LDQ; y++)
            expect(got[x * LDQ + y] == GUARD, "%s[%d][%d] written past the tile", what, x, y);
    expect(got[lines * LDQ] == GUARD, "%s line %d written past the tile", what, lines);
}

/* ---- qk: st (nk, LDQ) = K · Qt; qk_dot: the decoding tile st (nq, LDQ) = Q · Kᵀ -- */

static void qk_case(const attnx_kernels *kt, int nq, int nk, int D, int exact, int dot)
{
    const int k_sl = D + 3;
    float *q = malloc(sizeof(float) * (size_t)(D * LDQ)), *k = malloc(sizeof(float) * nk * k_sl);
    const size_t lines = (size_t)(dot ? nq : nk) + 1; /* (nk, LDQ), or (nq, LDQ) for qk_dot */
    float *st = guarded(lines * LDQ), *ref = guarded(lines * LDQ);
    float *bound = calloc((size_t)nk * LDQ, sizeof(float));
    fill(q, (size_t)D * LDQ, exact); /* qt (D, LDQ), or rows (nq, D) for qk_dot */
    fill(k, (size_t)nk * k_sl, exact);
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i++) {
            double mag = 0.0;
            for (int d = 0; d < D; d++)
                mag += fabs((double)k[j * k_sl + d] * (dot ? q[i * D + d] : q[d * LDQ + i]));
            bound[j * LDQ + i] = (float)((D + 2) * 0x1p-23 * mag);
        }
    if (dot) { /* nk <= 17 keys and nq <= 8 rows fit the tile */
        kt->qk_dot(q, D, nq, k, k_sl, nk, st, LDQ);
        attnx_kernels_scalar.qk_dot(q, D, nq, k, k_sl, nk, ref, LDQ);
        cur.cases++;
        compare_tile(st, ref, nk, nq, 1, exact, bound, "st");
        free(q), free(k), free(st), free(ref), free(bound);
        return;
    } else {
        for (int d = 0; d < D; d++) /* lanes past nq: finite padding, as packed */
            for (int i = nq; i < LDQ; i++) q[d * LDQ + i] = 0.0f;
        kt->qk(q, LDQ, nq, k, k_sl, nk, D, st);
        attnx_kernels_scalar.qk(q, LDQ, nq, k, k_sl, nk, D, ref);
    }
    cur.cases++;
    compare_tile(st, ref, nk, nq, 0, exact, bound, "st");
    free(q), free(k), free(st), free(ref), free(bound);
}

static void test_qk(const char *isa, const attnx_kernels *kt, int dot)
{
    for (int exact = 1; exact >= 0; exact--) {
        begin(isa, dot ? "qk_dot" : "qk", exact ? "identical" : "summation");
        for (int a = 0; a < SMAX; a++)
            for (int b = 0; b < SMAX + NWIDE; b++)
                for (int nk = 1; nk <= 17; nk += (nk < 10 ? 1 : 7))
                    qk_case(kt, dot ? 1 + a % 8 : a + 1, nk, size_at(b), exact, dot);
        end();
    }
}

/* ---- pv and ptx: acc += Pᵀ-tile products ---------------------------------------- */

/* pv: acc (nq, ldacc) = alpha · acc + Σ_j pt[j][i] · v[j]; ptx: acc (nk, n)
 * += Σ_i pt[j][i] · x[i]. Rows of acc past the width keep their guard. pv
 * reads the tile as (nk, LDQ), or with rows set as the decoding tile (nq, LDQ). */
static void pv_case(const attnx_kernels *kt, int nq, int nk, int n, int exact, int transposed,
                    int with_alpha, int rows_tile)
{
    const int rows = transposed ? nk : nq, terms = transposed ? nq : nk, sl = n + 2;
    const int ld = ATTNX_ROUND16(n) + 16;
    float *pt = calloc((size_t)nk * LDQ, sizeof(float)), *x = malloc(sizeof(float) * terms * sl);
    float *acc = guarded((size_t)rows * ld), *ref = guarded((size_t)rows * ld), alpha[LDQ];
    for (int j = 0; j < nk; j++) fill(pt + j * LDQ, (size_t)nq, exact);
    fill(x, (size_t)terms * sl, exact);
    for (int r = 0; r < rows; r++) {
        fill(acc + r * ld, (size_t)n, exact);
        memcpy(ref + r * ld, acc + r * ld, sizeof(float) * (size_t)n);
    }
    for (int i = 0; i < LDQ; i++) alpha[i] = exact ? (float)(i % 3) * 0.5f : (float)urand();
    const float *al = with_alpha ? alpha : NULL;
    double *mag = calloc((size_t)rows * n, sizeof(double));
    for (int r = 0; r < rows; r++)
        for (int e = 0; e < n; e++) {
            mag[r * n + e] = fabs((double)acc[r * ld + e] * (al ? al[r] : 1.0f));
            for (int t = 0; t < terms; t++)
                mag[r * n + e] +=
                    fabs((double)(transposed ? pt[r * LDQ + t] : pt[t * LDQ + r]) * x[t * sl + e]);
        }
    if (transposed) {
        kt->ptx(pt, LDQ, nq, x, sl, nk, n, acc, ld);
        attnx_kernels_scalar.ptx(pt, LDQ, nq, x, sl, nk, n, ref, ld);
    } else if (rows_tile) { /* the same values as the decoding tile (nq, LDQ) */
        float *pr = calloc((size_t)(nq > nk ? nq : nk) * LDQ, sizeof(float));
        for (int j = 0; j < nk; j++)
            for (int i = 0; i < nq; i++) pr[i * LDQ + j] = pt[j * LDQ + i];
        kt->pv(pr, 1, LDQ, nq, x, sl, nk, n, al, acc, ld);
        attnx_kernels_scalar.pv(pt, LDQ, 1, nq, x, sl, nk, n, al, ref, ld);
        free(pr);
    } else {
        kt->pv(pt, LDQ, 1, nq, x, sl, nk, n, al, acc, ld);
        attnx_kernels_scalar.pv(pt, LDQ, 1, nq, x, sl, nk, n, al, ref, ld);
    }
    cur.cases++;
    for (int r = 0; r < rows; r++) {
        for (int e = 0; e < n; e++) {
            if (exact)
                expect_same(acc[r * ld + e], ref[r * ld + e], "acc", r, e);
            else
                expect_within(acc[r * ld + e], ref[r * ld + e],
                              (terms + 2) * 0x1p-23 * mag[r * n + e], "acc", r, e);
        }
        for (int e = n; e < ld; e++)
            expect(acc[r * ld + e] == GUARD, "acc[%d][%d] written past the row (n = %d)", r, e, n);
    }
    free(pt), free(x), free(acc), free(ref), free(mag);
}

static void test_pv(const char *isa, const attnx_kernels *kt, int transposed)
{
    static const int few[] = {1, 2, 3, 5, 8, 9, 17, 33};
    for (int exact = 1; exact >= 0; exact--) {
        begin(isa, transposed ? "ptx" : "pv", exact ? "identical" : "summation");
        for (int a = 0; a < SMAX; a++)             /* rows of the block: queries, or keys */
            for (int b = 0; b < SMAX + NWIDE; b++) /* the width: Dv, or D */
                for (int c = 0; c < 8; c++) {      /* the terms summed */
                    const int rows = a + 1, terms = few[c];
                    if (transposed)
                        pv_case(kt, terms, rows, size_at(b), exact, 1, 0, 0);
                    else
                        pv_case(kt, rows, terms, size_at(b), exact, 0, (a + b + c) % 3 != 0,
                                (a + b + c) % 2);
                }
        end();
    }
}

/* ---- softmax_online, softmax_final ------------------------------------------------ */

/* Scores of one lane: the kinds of rows the drivers meet. */
static float score(int kind, int i, int j)
{
    switch (kind) {
    case 0: return nrand() * 4.0f;
    case 1: return (j + i) % 3 ? -INFINITY : nrand(); /* masked keys */
    case 2: return -INFINITY;                         /* nothing allowed */
    case 3: { /* the row's max (5, at key 0), then scores at and past the flush below it */
        static const float below[] = {0.0f,   -87.33f, -87.3365f, ATTNX_EXP_LO, -87.3366f, -87.34f,
                                      -88.0f, -103.0f, -1e30f,    -INFINITY,    -87.0f,    -86.5f};
        return 5.0f + below[j == 0 ? 0 : (i + j) % 12];
    }
    case 4: return (i + j) % 7 == 3 ? NAN : nrand(); /* a NaN score */
    case 5: return (i + j) % 5 == 1 ? INFINITY : nrand();
    default: return nrand() * 30.0f;
    }
}

/* The tile in either layout: (nk, LDQ), or with rows set the decoding tile (nq, LDQ). */
static float *at_ij(float *st, int rows, int i, int j)
{
    return rows ? st + i * LDQ + j : st + j * LDQ + i;
}

static void softmax_case(const attnx_kernels *kt, int nq, int nk, int kind, int final, int rows)
{
    const size_t lines = (size_t)(rows ? nq : nk) + 1;
    float *st = guarded(lines * LDQ), *ref = guarded(lines * LDQ);
    float m[LDQ], l[LDQ], a[LDQ], rm[LDQ], rl[LDQ], ra[LDQ];
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < ATTNX_ROUND16(nq); i++)
            if (!rows || i < nq)
                *at_ij(st, rows, i, j) = *at_ij(ref, rows, i, j) =
                    i < nq ? score(kind, i, j) : 0.0f;
    for (int i = 0; i < LDQ; i++) {
        if (final) { /* the row's final max (or more, as an lse): no score lies above it */
            float mx = -INFINITY;
            for (int j = 0; j < nk && i < nq; j++) {
                const float s = *at_ij(st, rows, i, j);
                mx = s > mx ? s : mx;
            }
            m[i] = i >= nq ? INFINITY : mx + (kind == 3 || i % 2 ? 0.0f : (float)urand() * 3.0f);
            a[i] = (float)urand();
        } else { /* the running max and sum of the tiles before, or none */
            m[i] = (i + kind) % 4 == 0 ? -INFINITY : kind == 3 ? 4.0f : nrand() * 3.0f;
            l[i] = m[i] == -INFINITY ? 0.0f : (float)(1.0 + urand() * 10.0);
            a[i] = GUARD;
        }
        rm[i] = m[i], rl[i] = l[i], ra[i] = a[i];
    }
    const attnx_kernels *sc = &attnx_kernels_scalar;
    if (final && rows) {
        kt->softmax_rows_final(st, LDQ, nq, nk, m, a);
        sc->softmax_rows_final(ref, LDQ, nq, nk, rm, ra);
    } else if (final) {
        kt->softmax_final(st, LDQ, nq, nk, m, a);
        sc->softmax_final(ref, LDQ, nq, nk, rm, ra);
    } else if (rows) {
        kt->softmax_rows(st, LDQ, nq, nk, m, l, a);
        sc->softmax_rows(ref, LDQ, nq, nk, rm, rl, ra);
    } else {
        kt->softmax_online(st, LDQ, nq, nk, m, l, a);
        sc->softmax_online(ref, LDQ, nq, nk, rm, rl, ra);
    }
    cur.cases++;
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i++) /* exp, and for the final ones a product after it */
            expect_ulps(*at_ij(st, rows, i, j), *at_ij(ref, rows, i, j), final ? 3 : 2, "p", j, i);
    for (int i = 0; i < nq && !final; i++) {
        expect_same(m[i], rm[i], "m", i, 0);
        expect_ulps(a[i], ra[i], 2, "alpha", i, 0);
        expect_within(l[i], rl[i], (nk + 4) * 0x1p-23 * fabs(rl[i]), "l", i, 0);
    }
    if (rows) /* the decoding tile: nothing past nk in a row, nor past row nq */
        for (int i = 0; i < nq; i++)
            for (int j = nk; j < LDQ; j++)
                expect(st[i * LDQ + j] == GUARD, "st[%d][%d] written past nk", i, j);
    else
        for (int j = 0; j < nk; j++)
            for (int i = ATTNX_ROUND16(nq); i < LDQ; i++)
                expect(st[j * LDQ + i] == GUARD, "st[%d][%d] written past the vectors", j, i);
    expect(st[(lines - 1) * LDQ] == GUARD, "st written past its last line");
    free(st), free(ref);
}

static void test_softmax(const char *isa, const attnx_kernels *kt, int final, int rows)
{
    static const char *const names[2][2] = {{"softmax_online", "softmax_final"},
                                            {"softmax_rows", "softmax_rows_final"}};
    begin(isa, names[rows][final], "ulps");
    for (int nq = 1; nq <= (rows ? 8 : SMAX); nq++) /* decoding: at most 8 rows */
        for (int nk = 1; nk <= (rows ? LDQ : SMAX); nk += (rows && nk > SMAX ? 7 : 1))
            for (int kind = 0; kind < 7; kind++) softmax_case(kt, nq, nk, kind, final, rows);
    end();
}

/* ---- masks ------------------------------------------------------------------------- */

/* Element (i, j) of a mask at base[i*sq + j*sk], strides of any sign: the
 * lowest and highest offsets reached. */
static void reach(int nq, int nk, int64_t sq, int64_t sk, int64_t *lo, int64_t *hi)
{
    const int64_t a = (int64_t)(nq - 1) * sq, b = (int64_t)(nk - 1) * sk;
    *lo = (a < 0 ? a : 0) + (b < 0 ? b : 0);
    *hi = (a > 0 ? a : 0) + (b > 0 ? b : 0);
}

static void mask_case(const attnx_kernels *kt, int nq, int nk, int64_t sq, int64_t sk, int boolean)
{
    int64_t lo, hi;
    reach(nq, nk, sq, sk, &lo, &hi);
    const size_t n = (size_t)(hi - lo + 1) + 8; /* 4 spare on each side: the byte gathers */
    unsigned char *bytes = boolean ? calloc(n, 1) : NULL;
    float *floats = boolean ? NULL : calloc(n, sizeof(float));
    for (int i = 0; i < nq; i++) /* the elements read (the rest may lie far apart) */
        for (int j = 0; j < nk; j++) {
            const int64_t e = 4 - lo + i * sq + j * sk;
            if (boolean)
                bytes[e] = urand() < 0.4 ? 0 : (unsigned char)(1 + urand() * 255);
            else
                floats[e] = urand() < 0.2 ? -INFINITY : nrand();
        }
    float *st = guarded((size_t)(nk + 1) * LDQ), *ref = guarded((size_t)(nk + 1) * LDQ);
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < ATTNX_ROUND16(nq); i++)
            st[j * LDQ + i] = ref[j * LDQ + i] = (i + j) % 9 == 4 ? NAN : nrand();
    if (boolean) {
        kt->mask_bool(st, LDQ, nq, nk, bytes + 4 - lo, sq, sk);
        attnx_kernels_scalar.mask_bool(ref, LDQ, nq, nk, bytes + 4 - lo, sq, sk);
    } else {
        kt->mask_float(st, LDQ, nq, nk, floats + 4 - lo, sq, sk);
        attnx_kernels_scalar.mask_float(ref, LDQ, nq, nk, floats + 4 - lo, sq, sk);
    }
    cur.cases++;
    compare_tile(st, ref, nk, nq, 0, 1, NULL, "st");
    free(bytes), free(floats), free(st), free(ref);
}

static void test_mask(const char *isa, const attnx_kernels *kt, int boolean)
{
    begin(isa, boolean ? "mask_bool" : "mask_float", "identical");
    for (int nq = 1; nq <= SMAX; nq++)
        for (int nk = 1; nk <= 17; nk++) {
            /* row-major, reversed, per key (sq = 0), transposed (sq = 1: a decoding
             * tile's view, also constant along the keys), strided, far apart */
            const int64_t strides[][2] = {
                {nk, 1},         {-nk, -1},          {0, 1},      {0, -3},       {1, nq}, {-1, -nq},
                {3 * nk + 5, 3}, {-(2 * nk + 1), 2}, {100003, 1}, {-100003, -1}, {1, 0}};
            for (int s = 0; s < 11; s++)
                mask_case(kt, nq, nk, strides[s][0], strides[s][1], boolean);
        }
    end();
}

/* ---- pack_qt: qt (D, LDQ) = scale · Qᵀ, zero-padded to 16 ------------------------------- */

static void pack_case(const attnx_kernels *kt, int nq, int D, int64_t q_sl)
{
    int64_t lo, hi;
    reach(nq, D, q_sl, 1, &lo, &hi);
    float *buf = calloc((size_t)(hi - lo + 1), sizeof(float)), *q = buf - lo; /* row 0 at q */
    for (int i = 0; i < nq; i++)
        for (int d = 0; d < D; d++)
            q[i * q_sl + d] = (i + d) % 17 == 5 ? INFINITY : (i + d) % 19 == 7 ? NAN : nrand();
    float *qt = guarded((size_t)(D + 1) * LDQ), *ref = guarded((size_t)(D + 1) * LDQ);
    const float scale = 0.37f;
    kt->pack_qt(q, q_sl, nq, D, scale, qt, LDQ);
    attnx_kernels_scalar.pack_qt(q, q_sl, nq, D, scale, ref, LDQ);
    cur.cases++;
    for (int d = 0; d < D; d++)
        for (int i = 0; i < ATTNX_ROUND16(nq); i++)
            expect_same(qt[d * LDQ + i], ref[d * LDQ + i], "qt", d, i);
    compare_tile(qt, ref, D, nq, 0, 1, NULL, "qt"); /* and the guards past the padding */
    free(buf), free(qt), free(ref);
}

static void test_pack(const char *isa, const attnx_kernels *kt)
{
    begin(isa, "pack_qt", "identical");
    for (int nq = 1; nq <= SMAX; nq++)
        for (int D = 1; D <= SMAX; D++) {
            const int64_t strides[] = {D, D + 3, -D, -(D + 5), 0, 100003, -100003, 65537};
            for (int s = 0; s < 8; s++) pack_case(kt, nq, D, strides[s]);
        }
    end();
}

/* ---- store_rows: out = acc · inv, and whether anything stored is inf or NaN ------------ */

static void store_case(const attnx_kernels *kt, int nq, int Dv, int special)
{
    const int ldacc = ATTNX_ROUND16(Dv), out_sl = Dv + 3;
    float *acc = malloc(sizeof(float) * nq * ldacc), inv[LDQ];
    float *out = guarded((size_t)nq * out_sl), *ref = guarded((size_t)nq * out_sl);
    fill(acc, (size_t)nq * ldacc, 0);
    for (int i = 0; i < nq; i++) inv[i] = i % 4 == 1 ? 0.0f : (float)(0.1 + urand());
    if (special == 1) acc[(nq / 2) * ldacc + Dv - 1] = INFINITY; /* an inf stored */
    if (special == 2) acc[(nq - 1) * ldacc] = NAN;               /* a NaN stored */
    if (special == 3 && nq > 1) acc[1 * ldacc + Dv / 2] = NAN;   /* in a row of inv 0: zeros */
    if (special == 4) inv[0] = 1e38f, acc[0] = 1e10f;            /* overflows to inf */
    const int flag = kt->store_rows(acc, ldacc, nq, Dv, inv, out, out_sl);
    const int want = attnx_kernels_scalar.store_rows(acc, ldacc, nq, Dv, inv, ref, out_sl);
    cur.cases++;
    expect(!flag == !want, "returned %d, scalar %d (special %d)", flag, want, special);
    for (int i = 0; i < nq; i++) {
        for (int d = 0; d < Dv; d++)
            expect_same(out[i * out_sl + d], ref[i * out_sl + d], "out", i, d);
        for (int d = Dv; d < out_sl; d++)
            expect(out[i * out_sl + d] == GUARD, "out[%d][%d] written past Dv", i, d);
    }
    free(acc), free(out), free(ref);
}

static void test_store(const char *isa, const attnx_kernels *kt)
{
    begin(isa, "store_rows", "identical");
    for (int nq = 1; nq <= SMAX; nq++)
        for (int b = 0; b < SMAX + NWIDE; b++)
            for (int special = 0; special < 5; special++) store_case(kt, nq, size_at(b), special);
    end();
}

/* ---- softmax_bwd: dS = P ∘ (dP − d), exactly 0 where P is 0 ----------------------------- */

static void softmax_bwd_case(const attnx_kernels *kt, int nq, int nk)
{
    float *pt = guarded((size_t)(nk + 1) * LDQ), *dp = guarded((size_t)(nk + 1) * LDQ);
    float *ref = guarded((size_t)(nk + 1) * LDQ), d[LDQ];
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < ATTNX_ROUND16(nq); i++) {
            pt[j * LDQ + i] = (i + 2 * j) % 5 == 0 ? 0.0f : (float)urand();
            dp[j * LDQ + i] = ref[j * LDQ + i] = (i + j) % 11 == 3   ? NAN
                                                 : (i + j) % 13 == 5 ? INFINITY
                                                                     : nrand();
        }
    for (int i = 0; i < LDQ; i++) d[i] = nrand();
    kt->softmax_bwd(pt, dp, LDQ, nq, nk, d);
    attnx_kernels_scalar.softmax_bwd(pt, ref, LDQ, nq, nk, d);
    cur.cases++;
    compare_tile(dp, ref, nk, nq, 0, 1, NULL, "ds");
    free(pt), free(dp), free(ref);
}

static void test_softmax_bwd(const char *isa, const attnx_kernels *kt)
{
    begin(isa, "softmax_bwd", "identical");
    for (int nq = 1; nq <= SMAX; nq++)
        for (int nk = 1; nk <= SMAX; nk++) softmax_bwd_case(kt, nq, nk);
    end();
}

/* ---- softcap: st = cap · tanh(st / cap), softcap_bwd, alibi ------------------------- */

/* Scores around every branch of the tanh: 0, the polynomial's edge at
 * ±0.625·cap, large, ±inf, NaN, and random ones. */
static float cap_score(int i, int j, float cap)
{
    static const float edge[] = {0.0f, 0.6249f, 0.625f, 0.6251f, 20.0f, 44.0f, INFINITY, NAN};
    const int n = (int)(sizeof edge / sizeof *edge), at = (i + 3 * j) % (2 * n + 3);
    if (at < 2 * n) return (at % 2 ? -1.0f : 1.0f) * edge[at / 2] * cap;
    return 3.0f * cap * nrand();
}

static void softcap_case(const attnx_kernels *kt, int nq, int nk, float cap)
{
    float *st = guarded((size_t)(nk + 1) * LDQ), *ref = guarded((size_t)(nk + 1) * LDQ);
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < ATTNX_ROUND16(nq); i++)
            st[j * LDQ + i] = ref[j * LDQ + i] = cap_score(i, j, cap);
    kt->softcap(st, LDQ, nq, nk, cap, 1.0f / cap);
    attnx_kernels_scalar.softcap(ref, LDQ, nq, nk, cap, 1.0f / cap);
    cur.cases++;
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i++)
            expect_ulps(st[j * LDQ + i], ref[j * LDQ + i], 2, "softcap", j, i);
    compare_tile(st, st, nk, nq, 0, 1, NULL, "softcap"); /* the guards */
    free(st), free(ref);
}

/* The scalar tanh against the C library's, and the SIMD softcap against it. */
static void test_softcap(const char *isa, const attnx_kernels *kt)
{
    begin(isa, "softcap", "ulps");
    for (int k = -4000; k <= 4000; k++) { /* attnx_tanhf within 3 ulp of tanh */
        const float x = (float)k / 400.0f, want = (float)tanh((double)x);
        cur.cases++;
        expect_ulps(attnx_tanhf(x), want, 3, "attnx_tanhf", k, 0);
    }
    for (int nq = 1; nq <= SMAX; nq += 3)
        for (int nk = 1; nk <= SMAX; nk += 4) {
            softcap_case(kt, nq, nk, 1.0f);
            softcap_case(kt, nq, nk, 30.0f);
        }
    end();
}

static void softcap_bwd_case(const attnx_kernels *kt, int nq, int nk)
{
    float *ds = guarded((size_t)(nk + 1) * LDQ), *ref = guarded((size_t)(nk + 1) * LDQ);
    float *capped = guarded((size_t)(nk + 1) * LDQ);
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < ATTNX_ROUND16(nq); i++) {
            ds[j * LDQ + i] = ref[j * LDQ + i] = (i + j) % 7 == 2 ? 0.0f : nrand();
            capped[j * LDQ + i] = 5.0f * (float)(2.0 * urand() - 1.0);
        }
    kt->softcap_bwd(ds, capped, LDQ, nq, nk, 0.2f);
    attnx_kernels_scalar.softcap_bwd(ref, capped, LDQ, nq, nk, 0.2f);
    cur.cases++;
    compare_tile(ds, ref, nk, nq, 0, 1, NULL, "ds");
    free(ds), free(ref), free(capped);
}

static void alibi_case(const attnx_kernels *kt, int nq, int nk, float slope, int64_t c)
{
    float *st = guarded((size_t)(nk + 1) * LDQ), *ref = guarded((size_t)(nk + 1) * LDQ);
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < ATTNX_ROUND16(nq); i++)
            st[j * LDQ + i] = ref[j * LDQ + i] = (i + j) % 9 == 4 ? -INFINITY : nrand();
    kt->alibi(st, LDQ, nq, nk, slope, c);
    attnx_kernels_scalar.alibi(ref, LDQ, nq, nk, slope, c);
    cur.cases++;
    compare_tile(st, ref, nk, nq, 0, 1, NULL, "alibi");
    free(st), free(ref);
}

static void test_score_steps(const char *isa, const attnx_kernels *kt)
{
    begin(isa, "softcap_bwd", "identical");
    for (int nq = 1; nq <= SMAX; nq += 2)
        for (int nk = 1; nk <= SMAX; nk += 3) softcap_bwd_case(kt, nq, nk);
    end();
    begin(isa, "alibi", "identical");
    static const int64_t cs[] = {0, 5, -40, 1000, -123456};
    for (int nq = 1; nq <= SMAX; nq += 2)
        for (int nk = 1; nk <= SMAX; nk += 3)
            for (int c = 0; c < 5; c++) alibi_case(kt, nq, nk, c % 2 ? 0.0625f : 0.7f, cs[c]);
    end();
}

/* ---- 16-bit keys and values (IEEE half and bfloat16): half_rows exact;
 * qk_dot_half and pv_half the same bits as qk_dot and pv on the converted rows */

/* 16 random bits: sign, exponent and mantissa (inf and NaN included). */
static uint16_t random_half(void) { return (uint16_t)(urand() * 65536.0); }

/* A small finite value of format fmt, for the products. */
static uint16_t small_half(int fmt)
{
    if (fmt == ATTNX_HALF_BF16) /* exponent 2^-4 .. 2^4, 7 mantissa bits */
        return (uint16_t)((random_half() & 0x807fu) | (uint16_t)((123 + (int)(urand() * 9)) << 7));
    return (uint16_t)((random_half() & 0x83ffu) | (uint16_t)((12 + (int)(urand() * 6)) << 10));
}

/* One case: accumulator rows (nq, D), ldacc apart, with the same bits as the
 * reference's, and the guard after them untouched. */
static void same_rows(const float *acc, const float *ref, int nq, int D, int64_t ldacc,
                      const char *what)
{
    cur.cases++;
    for (int i = 0; i < nq; i++)
        for (int d = 0; d < D; d++) expect_same(acc[i * ldacc + d], ref[i * ldacc + d], what, i, d);
    expect(acc[nq * ldacc] == GUARD, "%s wrote past its rows", what);
}

static const char *const FORMAT_NAMES[] = {"half", "bfloat16"}; /* by attnx_half_format */

static void half_case(const attnx_kernels *kt, int fmt, int nq, int nk, int D)
{
    const int64_t sl = D + 3; /* rows further apart than their width */
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(nk * sl));
    float *f = guarded((size_t)nk * D + 1), *ref = guarded((size_t)nk * D + 1);
    for (int64_t x = 0; x < nk * sl; x++) h[x] = small_half(fmt);
    kt->half_rows(fmt, h, sl, nk, D, f);
    attnx_kernels_scalar.half_rows(fmt, h, sl, nk, D, ref);
    cur.cases++;
    for (int j = 0; j < nk; j++)
        for (int d = 0; d < D; d++) expect_same(f[j * D + d], ref[j * D + d], "half_rows", j, d);
    expect(f[nk * D] == GUARD, "half_rows wrote past its rows");
    float *qr = guarded((size_t)nq * D), *st = guarded((size_t)(nq + 1) * LDQ);
    float *st2 = guarded((size_t)(nq + 1) * LDQ);
    for (int x = 0; x < nq * D; x++) qr[x] = nrand();
    kt->qk_dot_half(fmt, qr, D, nq, h, sl, nk, st, LDQ);
    kt->qk_dot(qr, D, nq, f, D, nk, st2, LDQ);
    compare_tile(st, st2, nk, nq, 1, 1, NULL, "qk_dot_half");
    /* pv_half against pv on the converted rows; with and without the rescale */
    const int64_t ldacc = D + 2;
    float *acc = guarded((size_t)nq * ldacc + 1), *acc2 = guarded((size_t)nq * ldacc + 1);
    float alpha[ATTNX_ROUND16(4)];
    for (int i = 0; i < nq; i++) alpha[i] = (float)urand();
    for (int rescale = 0; rescale < 2; rescale++) {
        for (int64_t x = 0; x < nq * ldacc; x++) acc[x] = acc2[x] = nrand();
        kt->pv_half(fmt, st2, 1, LDQ, nq, h, sl, nk, D, rescale ? alpha : NULL, acc, ldacc);
        kt->pv(st2, 1, LDQ, nq, f, D, nk, D, rescale ? alpha : NULL, acc2, ldacc);
        same_rows(acc, acc2, nq, D, ldacc, "pv_half");
    }
    free(h), free(f), free(ref), free(qr), free(st), free(st2), free(acc), free(acc2);
}

static void test_half(const char *isa, const attnx_kernels *kt, int fmt)
{
    char what[96];
    snprintf(what, sizeof what, "half_rows, qk_dot_half, pv_half (%s)", FORMAT_NAMES[fmt]);
    begin(isa, what, "identical");
    for (int nq = 1; nq <= kt->dot_max_nq; nq++)
        for (int nk = 1; nk <= 9; nk += 4)
            for (int D = 1; D <= SMAX; D += 3) half_case(kt, fmt, nq, nk, D);
    for (int x = 0; x < 65536; x++) { /* every value, against the scalar conversion */
        float a, b;
        kt->half_rows(fmt, (const uint16_t[]){(uint16_t)x}, 1, 1, 1, &a);
        b = fmt == ATTNX_HALF_BF16 ? attnx_bf16_to_float((uint16_t)x)
                                   : attnx_half_to_float((uint16_t)x);
        cur.cases++;
        expect_same(a, b, FORMAT_NAMES[fmt], x, 0);
    }
    if (fmt == ATTNX_HALF_BF16) { /* and bfloat16 is the top half of the float's bits */
        float a;
        kt->half_rows(fmt, (const uint16_t[]){0x3fc0u}, 1, 1, 1, &a);
        cur.cases++;
        expect(a == 1.5f, "bfloat16 0x3fc0 is not 1.5");
    }
    end();
}

/* ---- bfloat16 dot products: attnx_pack_qt_bf16, qk_bf16 ---------------------------
 * The packing is exact and says whether it was; the reference
 * attnx_qk_bf16_scalar does the steps of the contract (the float64 sum within
 * the summation bound on ordinary values; subnormals flushed; the odd dim of
 * a pair first); the kernel of a table that has one gives the reference's
 * bits, inf and NaN included. */

/* A random bfloat16 value: ordinary (exponents 2^-4 .. 2^4), or any 16 bits
 * (inf, NaN, subnormals, huge and tiny values), or a subnormal. */
static uint16_t random_bf16(int kind)
{
    if (kind == 0) return small_half(ATTNX_HALF_BF16);
    if (kind == 1) return random_half();
    return (uint16_t)(random_half() & 0x807fu); /* exponent 0: zero or subnormal */
}

static float bf16_value(uint16_t h) { return attnx_bf16_to_float(h); }

static void pack_bf16_case(int nq, int D, int64_t q_sl)
{
    const int pairs = (D + 1) / 2;
    float *q = malloc(sizeof(float) * (size_t)(nq * q_sl));
    for (int64_t x = 0; x < nq * q_sl; x++) q[x] = bf16_value(random_bf16(1));
    uint32_t *qt2 = malloc(sizeof(uint32_t) * (size_t)(pairs + 1) * LDQ);
    for (int x = 0; x < (pairs + 1) * LDQ; x++) qt2[x] = 0xdeadbeefu;
    cur.cases++;
    expect(attnx_pack_qt_bf16(q, q_sl, nq, D, qt2, LDQ) == 1, "bfloat16 values not exact");
    for (int p = 0; p < pairs; p++)
        for (int i = 0; i < LDQ; i++) {
            uint32_t want = 0xdeadbeefu;
            if (i < nq) {
                want = bits(q[i * q_sl + 2 * p]) >> 16;
                if (2 * p + 1 < D) want |= bits(q[i * q_sl + 2 * p + 1]) & 0xffff0000u;
            } else if (i < ATTNX_ROUND16(nq)) {
                want = 0;
            }
            expect(qt2[p * LDQ + i] == want, "qt2[%d][%d] = %08x, want %08x", p, i,
                   qt2[p * LDQ + i], want);
        }
    for (int i = 0; i < LDQ; i++)
        expect(qt2[pairs * LDQ + i] == 0xdeadbeefu, "qt2 written past its pairs");
    /* one value that is no bfloat16 (a low bit set): not exact */
    const int i = (int)(urand() * nq), d = (int)(urand() * D);
    const uint32_t u = bits(q[i * q_sl + d]) | 1u;
    memcpy(&q[i * q_sl + d], &u, sizeof u);
    cur.cases++;
    expect(attnx_pack_qt_bf16(q, q_sl, nq, D, qt2, LDQ) == 0, "q[%d][%d] = %08x read as exact", i,
           d, u);
    free(q), free(qt2);
}

static void test_pack_bf16(void)
{
    begin("any", "pack_qt_bf16", "identical");
    for (int nq = 1; nq <= SMAX; nq += 2)
        for (int D = 1; D <= SMAX; D++) pack_bf16_case(nq, D, D + nq % 3);
    pack_bf16_case(LDQ, 128, 129);
    end();
}

/* The row of attnx_isas named isa, or NULL. */
static const attnx_isa *isa_row(const char *isa)
{
    for (int s = 0; s < attnx_isa_total; s++)
        if (strcmp(attnx_isas[s].name, isa) == 0) return &attnx_isas[s];
    return NULL;
}

/* A bfloat16 value as the dot products read it: subnormals are 0. */
static double bf16_flushed(uint16_t h)
{
    const float v = bf16_value(h);
    return fabsf(v) < 0x1p-126f ? 0.0 : v;
}

/* One tile: qt2 packed from random bfloat16 values, keys k (nk, D) rows k_sl
 * apart (k_sl = D: the last row ends where its buffer does). Fills st with
 * kt->qk_bf16 (or the reference for kt NULL), ref with the reference. mode 0:
 * st must be ref's bits; 1: also ref within the summation bound of the
 * float64 sum (ordinary values); 2: st within that bound (a kernel that
 * sums its own way: AMX), and NaN and inf where ref has them. */
static void qk_bf16_case(const attnx_kernels *kt, int nq, int nk, int D, int64_t k_sl, int kind,
                         float scale, int mode)
{
    const int pairs = (D + 1) / 2;
    float *q = malloc(sizeof(float) * (size_t)(nq * D));
    uint16_t *k = malloc(sizeof(uint16_t) * (size_t)((nk - 1) * k_sl + D));
    for (int x = 0; x < nq * D; x++) q[x] = bf16_value(random_bf16(kind == 2 ? x % 2 * 2 : kind));
    for (int64_t x = 0; x < (nk - 1) * k_sl + D; x++) k[x] = random_bf16(kind == 2 ? 0 : kind);
    uint32_t *qt2 = malloc(sizeof(uint32_t) * (size_t)pairs * LDQ);
    attnx_pack_qt_bf16(q, D, nq, D, qt2, LDQ);
    float *st = guarded((size_t)(nk + 1) * LDQ), *ref = guarded((size_t)(nk + 1) * LDQ);
    attnx_qk_bf16_scalar(qt2, LDQ, nq, k, k_sl, nk, D, scale, ref);
    cur.cases++;
    if (kt) kt->qk_bf16(qt2, LDQ, nq, k, k_sl, nk, D, scale, st);
    if (kt && mode < 2) compare_tile(st, ref, nk, nq, 0, 1, NULL, "st");
    const float *checked = mode == 2 ? st : ref;
    if (mode) /* a float32 sum of the products, in some order */
        for (int j = 0; j < nk; j++)
            for (int i = 0; i < nq; i++) {
                const float got = checked[j * LDQ + i], want = ref[j * LDQ + i];
                if (isnan(want) || isinf(want)) { /* special values (kind 1) */
                    /* inf: the reference's, or (AMX, summing in another order: an
                     * overflow of either sign may come first) any inf or NaN */
                    const int ok = isnan(want) ? isnan(got) != 0
                                               : got == want || (mode == 2 && !isfinite(got));
                    cur.cases++;
                    expect(ok, "st[%d][%d] = %g, want %g", j, i, got, want);
                    continue;
                }
                double sum = 0.0, mag = 0.0;
                for (int d = 0; d < D; d++) {
                    const double t =
                        bf16_flushed(bits(q[i * D + d]) >> 16) * bf16_flushed(k[j * k_sl + d]);
                    sum += t;
                    mag += fabs(t);
                }
                /* AMX flushes its partial sums below 2^-126 too: up to D of them lost */
                const double flushed = mode == 2 ? fabs(scale) * D * 0x1p-126 : 0.0;
                const double bound = fabs(scale) * ((D + 2) * 0x1p-23 * mag) +
                                     fabs(scale * sum) * 0x1p-24 + 0x1p-126 + flushed;
                if (kind == 1 && !(mag < 0x1p100)) continue; /* near overflow: either may */
                expect_within(got, (float)(scale * sum), bound, mode == 2 ? "st" : "reference", j,
                              i);
            }
    free(q), free(k), free(qt2), free(st), free(ref);
}

/* The reference's own steps, on values chosen to show them. */
static void test_qk_bf16_reference(void)
{
    begin("any", "qk_bf16 reference", "summation");
    for (int D = 1; D <= 70; D += 3)
        for (int nk = 1; nk <= 9; nk += 4) qk_bf16_case(NULL, 5, nk, D, D + 1, 0, 0.37f, 1);
    end();
    begin("any", "qk_bf16 reference steps", "identical");
    /* pairs of dims (0, 1) and (2, 3): the odd dim of a pair is added first.
     * q = (1, 0, 2^-24, 2^-24 + 2^-31), k = 1: 1 + (2^-24 + 2^-31) rounds up to
     * 1 + 2^-23, and + 2^-24 is then a tie, to even: 1 + 2^-22 (the even dim
     * first would give 1, then 1 + 2^-23) */
    const float qv[4] = {1.0f, 0.0f, 0x1p-24f, 0x1p-24f + 0x1p-31f};
    const uint16_t one[4] = {0x3f80u, 0x3f80u, 0x3f80u, 0x3f80u};
    uint32_t qt2[2 * 16];
    float st[16];
    attnx_pack_qt_bf16(qv, 4, 1, 4, qt2, 16);
    attnx_qk_bf16_scalar(qt2, 16, 1, one, 4, 1, 4, 1.0f, st);
    cur.cases++;
    expect(st[0] == 1.0f + 0x1p-22f, "order: %a, want 1 + 2^-22", st[0]);
    /* a subnormal input is 0: 2^-130 · 2^100 would be 2^-30 */
    const float sub[2] = {0x1p-130f, 0.0f};
    uint16_t k2[2] = {(127 + 100) << 7, 0}; /* 2^100 */
    attnx_pack_qt_bf16(sub, 2, 1, 2, qt2, 16);
    attnx_qk_bf16_scalar(qt2, 16, 1, k2, 2, 1, 2, 1.0f, st);
    cur.cases++;
    expect(st[0] == 0.0f, "subnormal input: %a, want 0", st[0]);
    /* a subnormal result is 0: 2^-70 · 2^-70 = 2^-140 */
    const float tiny[2] = {0x1p-70f, 0.0f};
    k2[0] = (127 - 70) << 7;
    attnx_pack_qt_bf16(tiny, 2, 1, 2, qt2, 16);
    attnx_qk_bf16_scalar(qt2, 16, 1, k2, 2, 1, 2, 1.0f, st);
    cur.cases++;
    expect(st[0] == 0.0f, "subnormal result: %a, want 0", st[0]);
    end();
}

/* Every bfloat16 dot product of an instruction set that this CPU has: the
 * reference's bits, or (AMX) within the summation bound over the sizes its
 * tiles take (D a multiple of 32, 16 keys and more: blocks of 1 and 2 key
 * and query tiles and the keys left over) and those they leave to
 * vdpbf16ps. */
static void test_qk_bf16(const char *isa)
{
    static const float scales[] = {0.125f, 0.37f, 1.0f, 3.0f};
    static const int dims[] = {1, 24, 32, 47, 64, 70, 96, 128};
    const attnx_isa *row = isa_row(isa);
    if (!row || !row->dots) {
        printf("  %-7s %-15s (none: the float32 path)\n", isa, "qk_bf16");
        return;
    }
    for (const attnx_dots *dots = row->dots; dots->name; dots++) {
        char what[64];
        snprintf(what, sizeof what, "qk_bf16 %s", dots->name);
        if (!dots->supported()) {
            printf("  %-7s %-15s not available here\n", isa, what);
            continue;
        }
        const attnx_kernels *kt = dots->kernels;
        begin(isa, what, dots->same_bits ? "identical" : "summation");
        for (int kind = 0; kind < 3; kind++)
            for (int a = 0; a < SMAX + NWIDE; a++)
                for (int x = 0; x < (a < SMAX ? 20 : 8); x++) {
                    const int D = a < SMAX ? x + 1 : dims[x];
                    for (int nk = 1; nk <= 70; nk += (nk < 10 ? 1 : nk < 17 ? 7 : 15))
                        qk_bf16_case(kt, size_at(a) > LDQ ? LDQ : size_at(a), nk, D,
                                     (a + nk) % 2 ? D : D + 3, kind, scales[(a + D) % 4],
                                     dots->same_bits ? 0 : 2);
                }
        end();
    }
}

/* ---- pv_bf16: P·V on tiles, into the transposed accumulator ---------------------------
 * A kernel that splits each probability exactly into three bfloat16 parts and
 * sums the tile products its own way: within the summation bound of the
 * float64 sum of 3·nk terms (plus what the flushes below 2^-126 lose), and
 * the reference's bits when a value is inf or NaN (it then takes FMAs). The
 * reference itself is checked against the float64 sum too. */

/* A probability as the softmax leaves it: in [0, 1], from 1 down to tiny
 * (2^-120), with all 24 bits in use, or 0. */
static float random_prob(void)
{
    const double u = urand();
    if (u < 0.05) return 0.0f;
    if (u < 0.1) return 1.0f;
    return (float)ldexp(urand(), -(int)(urand() * (u < 0.2 ? 120 : 12)));
}

/* ---- precision "medium": the references of the bfloat16-dot kernels --------------------
 * attnx_bf16_round rounds to the nearest bfloat16, ties to even (checked
 * against the two candidates in double, on random bits of every kind); the
 * rounded packing puts those values in attnx_pack_qt_bf16's layout; and
 * attnx_pv_medium_scalar is within the summation bound of the float64 sum
 * of its rounded products, within 2^-8 of each |p·v| more of the exact one,
 * and takes pairs of keys odd first (a case whose bits show the order). */

/* The float32 value of bfloat16 bits, inf as 2^128 (a distance to compare). */
static double bf16_as_double(uint32_t h)
{
    return (h & 0x7fffu) == 0x7f80u ? ((h & 0x8000u) ? -0x1p128 : 0x1p128)
                                    : bf16_value((uint16_t)h);
}

static void test_medium_reference(void)
{
    begin("any", "bf16_round", "identical");
    for (int n = 0; n < 200000; n++) {
        uint32_t u = (uint32_t)(urand() * 4294967296.0);
        if (n % 4 == 1) u = (u & 0xffff0000u) | 0x8000u; /* a tie */
        float x;
        memcpy(&x, &u, sizeof x);
        const uint16_t r = attnx_bf16_round(x);
        cur.cases++;
        if (isnan(x)) {
            expect(isnan(bf16_value(r)) && (r & 0x8000u) == ((u >> 16) & 0x8000u),
                   "NaN %08x gave %04x", u, r);
            continue;
        }
        const uint32_t lo = u >> 16, hi = lo + 1; /* |hi| > |lo|, same sign */
        const double dl = fabs((double)x - bf16_as_double(lo));
        const double dh = fabs((double)x - bf16_as_double(hi));
        const uint32_t want = dl < dh ? lo : dh < dl ? hi : (lo & 1u) ? hi : lo;
        expect(r == want, "%a (%08x) rounded to %04x, want %04x", x, u, r, want);
    }
    cur.cases++;
    expect(attnx_bf16_round(0x1.fffffep127f) == 0x7f80u, "the largest float: not inf");
    expect(attnx_bf16_round(-0.0f) == 0x8000u, "-0 lost its sign");
    cur.cases++;
    expect(attnx_bf16_round(ATTNX_BF16_INF_FROM) == 0x7f80u &&
               attnx_bf16_round(-ATTNX_BF16_INF_FROM) == 0xff80u &&
               attnx_bf16_round(nextafterf(ATTNX_BF16_INF_FROM, 0.0f)) == 0x7f7fu,
           "ATTNX_BF16_INF_FROM is not where rounding reaches inf");
    end();

    begin("any", "pack_qt_bf16_rounded", "identical");
    for (int nq = 1; nq <= 21; nq += 4)
        for (int D = 1; D <= 40; D += 3) {
            const int pairs = (D + 1) / 2;
            float *q = malloc(sizeof(float) * (size_t)(nq * D));
            uint32_t *qt2 = malloc(sizeof(uint32_t) * (size_t)(pairs + 1) * LDQ);
            for (int x = 0; x < nq * D; x++) q[x] = (float)(nrand() * ldexp(1.0, (x % 9) - 4));
            for (int x = 0; x < (pairs + 1) * LDQ; x++) qt2[x] = 0xdeadbeefu;
            attnx_pack_qt_bf16_rounded(q, D, nq, D, qt2, LDQ);
            cur.cases++;
            for (int p = 0; p < pairs; p++)
                for (int i = 0; i < LDQ; i++) {
                    uint32_t want = i < ATTNX_ROUND16(nq) ? 0u : 0xdeadbeefu;
                    if (i < nq) {
                        want = attnx_bf16_round(q[i * D + 2 * p]);
                        if (2 * p + 1 < D)
                            want |= (uint32_t)attnx_bf16_round(q[i * D + 2 * p + 1]) << 16;
                    }
                    expect(qt2[p * LDQ + i] == want, "qt2[%d][%d] = %08x, want %08x", p, i,
                           qt2[p * LDQ + i], want);
                }
            for (int i = 0; i < LDQ; i++)
                expect(qt2[pairs * LDQ + i] == 0xdeadbeefu, "qt2 written past its pairs");
            free(q), free(qt2);
        }
    end();

    begin("any", "pv_medium reference", "summation");
    for (int nk = 1; nk <= 41; nk += 5)
        for (int Dv = 1; Dv <= 33; Dv += 8) {
            const int nq = 1 + (nk + Dv) % 19;
            float *pt = malloc(sizeof(float) * (size_t)nk * LDQ), alpha[LDQ];
            uint16_t *v = malloc(sizeof(uint16_t) * (size_t)nk * Dv);
            float *acct = guarded((size_t)Dv * LDQ), *init = guarded((size_t)Dv * LDQ);
            for (int x = 0; x < nk * LDQ; x++) pt[x] = random_prob();
            for (int x = 0; x < nk * Dv; x++) v[x] = small_half(ATTNX_HALF_BF16);
            for (int i = 0; i < LDQ; i++) alpha[i] = (float)urand();
            for (int x = 0; x < Dv * LDQ; x++) init[x] = acct[x] = (float)nrand();
            const float *al = nk % 2 ? alpha : NULL;
            attnx_pv_medium_scalar(pt, LDQ, nq, v, Dv, nk, Dv, al, acct);
            for (int d = 0; d < Dv; d++)
                for (int i = 0; i < nq; i++) {
                    const double a = al ? al[i] * init[d * LDQ + i] : init[d * LDQ + i];
                    double rounded = a, exact = a, mag = fabs(a);
                    for (int j = 0; j < nk; j++) {
                        const double x = bf16_value(v[j * Dv + d]);
                        const double pr = bf16_value(attnx_bf16_round(pt[j * LDQ + i]));
                        const double p = pt[j * LDQ + i] < 0x1p-126f ? 0.0 : pr;
                        rounded += p * x;
                        exact += pt[j * LDQ + i] * x;
                        mag += fabs(pt[j * LDQ + i] * x);
                    }
                    cur.cases++;
                    const double sums = (nk + 2) * 0x1p-23 * mag + (nk + 1) * 0x1p-125;
                    expect_within(acct[d * LDQ + i], (float)rounded, sums, "acct", d, i);
                    expect_within(acct[d * LDQ + i], (float)exact, sums + 0x1p-8 * mag,
                                  "acct against exact P", d, i);
                }
            free(pt), free(v), free(acct), free(init);
        }
    end();

    begin("any", "pv_medium reference steps", "identical");
    /* keys 0 and 1, p = 1, v = 2^-24 and 2^-24 (1 + 2^-7), from acct = 1: the
     * odd key first gives 1 + 2^-23 then, a tie to even, 1 + 2^-22 (the even
     * key first would give 1, then 1 + 2^-23) */
    float pt2[2 * 16], acc2[16];
    const uint16_t v2[2] = {(127 - 24) << 7, (127 - 24) << 7 | 1};
    for (int x = 0; x < 32; x++) pt2[x] = 1.0f;
    acc2[0] = 1.0f;
    attnx_pv_medium_scalar(pt2, 16, 1, v2, 1, 2, 1, NULL, acc2);
    cur.cases++;
    expect(acc2[0] == 1.0f + 0x1p-22f, "order: %a, want 1 + 2^-22", acc2[0]);
    /* p rounded to bfloat16: 1 + 2^-8 + 2^-20 is past the tie, so 1 + 2^-7 */
    pt2[0] = 1.0f + 0x1p-8f + 0x1p-20f;
    acc2[0] = 0.0f;
    const uint16_t one = 0x3f80u;
    attnx_pv_medium_scalar(pt2, 16, 1, &one, 1, 1, 1, NULL, acc2);
    cur.cases++;
    expect(acc2[0] == 1.0f + 0x1p-7f, "p not rounded: %a, want 1 + 2^-7", acc2[0]);
    end();
}

/* kind 0: ordinary values; 1: any 16 bits (inf and NaN take the FMAs);
 * 2: subnormal values among ordinary ones. acct: (Dv + 1, LDQ), the last
 * row and the lanes past round16(nq) guards. */
static void pv_bf16_case(const attnx_kernels *kt, int nq, int nk, int Dv, int64_t v_sl, int kind,
                         int with_alpha, int medium, int same_bits)
{
    const size_t nv = (size_t)((nk ? nk - 1 : 0) * v_sl + Dv);
    float *pt = malloc(sizeof(float) * (size_t)(nk ? nk : 1) * LDQ), alpha[LDQ];
    uint16_t *v = malloc(sizeof(uint16_t) * nv);
    float *acct = guarded((size_t)(Dv + 1) * LDQ), *ref = guarded((size_t)(Dv + 1) * LDQ);
    float *init = guarded((size_t)Dv * LDQ);
    float *work = attnx_os_aligned_alloc(sizeof(float) * ATTNX_PV_BF16_WORK(128));
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < LDQ; i++) pt[j * LDQ + i] = random_prob();
    int special = 0;
    for (size_t x = 0; x < nv; x++) {
        v[x] = random_bf16(kind == 2 ? (urand() < 0.1 ? 2 : 0) : kind);
        special |= (v[x] & 0x7f80u) == 0x7f80u && (int64_t)x % v_sl < Dv;
    }
    for (int d = 0; d < Dv; d++)
        for (int i = 0; i < ATTNX_ROUND16(nq); i++)
            init[d * LDQ + i] = acct[d * LDQ + i] = ref[d * LDQ + i] = nrand();
    for (int i = 0; i < LDQ; i++) alpha[i] = (float)urand();
    const float *al = with_alpha ? alpha : NULL;
    (medium ? kt->pv_medium : kt->pv_bf16)(pt, LDQ, nq, v, v_sl, nk, Dv, al, acct, work);
    (medium ? attnx_pv_medium_scalar : attnx_pv_bf16_scalar)(pt, LDQ, nq, v, v_sl, nk, Dv, al, ref);
    cur.cases++;
    for (int d = 0; d < Dv; d++)
        for (int i = 0; i < nq; i++) {
            const float got = acct[d * LDQ + i], want = ref[d * LDQ + i];
            if (special || same_bits) { /* vdpbf16ps, or FMAs key by key: the reference's bits */
                expect_same(got, want, special ? "acct (inf or NaN values)" : "acct", d, i);
                continue;
            }
            const float a = al ? al[i] * init[d * LDQ + i] : init[d * LDQ + i];
            double sum = a, mag = fabs(a), vmax = 0.0;
            for (int j = 0; j < nk; j++) {
                /* "medium": P rounded to bfloat16, read as 0 below 2^-126 */
                const float pr = bf16_value(attnx_bf16_round(pt[j * LDQ + i]));
                const double p = !medium ? pt[j * LDQ + i] : fabsf(pr) < 0x1p-126f ? 0.0 : pr;
                const double x = bf16_value(v[j * v_sl + d]), t = p * x;
                sum += t;
                mag += fabs(t);
                vmax = fabs(x) > vmax ? fabs(x) : vmax;
            }
            /* the reference: nk FMAs; the tiles: 3 nk products, their parts,
             * values and sums flushed below 2^-126 */
            expect_within(want, (float)sum,
                          (nk + 2) * 0x1p-23 * mag + (medium ? (nk + 2) * 0x1p-125 : 0x1p-149),
                          "reference", d, i);
            expect_within(got, (float)sum,
                          (3 * nk + 2) * 0x1p-23 * mag + (4.0 * nk + 2) * 0x1p-125 * (1 + vmax),
                          "acct", d, i);
        }
    for (int d = 0; d < Dv; d++)
        for (int i = ATTNX_ROUND16(nq); i < LDQ; i++)
            expect(acct[d * LDQ + i] == GUARD, "acct[%d][%d] written past the queries", d, i);
    for (int i = 0; i < LDQ; i++)
        expect(acct[Dv * LDQ + i] == GUARD, "acct row %d (Dv) written", Dv);
    free(pt), free(v), free(acct), free(ref), free(init);
    attnx_os_aligned_free(work);
}

/* Every pv_bf16 (medium 0) or pv_medium (1) of an instruction set's
 * bfloat16 dot products that this CPU has: 1 and 2 tiles of dims and
 * queries, keys 1 .. BK (whole and partial rows of 32 keys, odd counts), with
 * and without the rescale; pv_medium bit for bit where the dot products give
 * the reference's bits (vdpbf16ps), else within the summation bound. */
static void test_pv_bf16(const char *isa, int medium)
{
    static const int dims[] = {16, 32, 48, 64, 80, 128};
    static const int keys[] = {1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 100, 127, 128};
    const attnx_isa *row = isa_row(isa);
    for (const attnx_dots *dots = row && row->dots ? row->dots : NULL; dots && dots->name; dots++) {
        if (!(medium ? dots->kernels->pv_medium : dots->kernels->pv_bf16) || !dots->supported())
            continue;
        char what[64];
        snprintf(what, sizeof what, "%s %s", medium ? "pv_medium" : "pv_bf16", dots->name);
        begin(isa, what, medium && dots->same_bits ? "identical" : "summation");
        for (int kind = 0; kind < 3; kind++)
            for (int a = 0; a < SMAX + NWIDE; a++)
                for (int x = 0; x < 6; x++)
                    for (int y = 0; y < 14; y += 1 + (a + x) % 3) {
                        const int nq = size_at(a) > LDQ ? LDQ : size_at(a), Dv = dims[x];
                        pv_bf16_case(dots->kernels, nq, keys[y], Dv, (a + y) % 2 ? Dv : Dv + 5,
                                     kind, (a + x + y) % 3 != 0, medium, medium && dots->same_bits);
                    }
        end();
    }
}

/* ---- float32 on tiles: split_rows, split_pairs, qk_split ---------------------------
 * The reference split (scalar.c) against its contract: three bfloat16 parts
 * that sum to x exactly, x1 the nearest 8-bit value, |x2| <= 2^-8 (1 + 2^-8)
 * |x| and |x3| <= 2^-16 |x|, zeros in the padding, the flag for |x| >= 2^100,
 * inf, NaN and 0 < |x| < 2^-80 (subnormals). A table's splits give the reference's bits. The
 * reference qk_split is within 2^-22 of sum |q·k| of the exact sum (the dropped products), and a
 * table's qk_split within the summation bound of the reference's float64 sum of its six products a
 * dim. */

/* A float for the split: ordinary (kind 0), any magnitude the split takes
 * (2^-100 .. 2^99, 1), anything (any 32 bits: tiny, subnormal, huge, inf,
 * NaN; 2). */
static float split_value(int kind)
{
    if (kind == 0) return nrand();
    if (kind == 1) return (float)ldexp(nrand(), (int)(urand() * 200) - 100);
    const uint32_t u = (uint32_t)(urand() * 4294967296.0);
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static int split_special(float x)
{
    return !(fabsf(x) < 0x1p100f) || (x != 0 && fabsf(x) < 0x1p-80f);
}

/* The parts of x at index at of parts (3, part), as floats. */
static void parts_of(const uint16_t *parts, int64_t part, int64_t at, float x3[3])
{
    for (int a = 0; a < 3; a++) x3[a] = attnx_bf16_to_float(parts[a * part + at]);
}

/* rows (rows, n) rows x_sl apart into parts (3, part) rows ldp apart, by the
 * reference and by kt (NULL: the reference alone); for odd n, ldp 32 more
 * than the padded width, whose columns the split leaves alone. */
static void split_rows_case(const attnx_kernels *kt, int rows, int n, int64_t x_sl, int kind)
{
    const int64_t width = (n + 31) / 32 * 32, ldp = width + (n % 2 ? 32 : 0);
    const int64_t part = (int64_t)(ATTNX_ROUND16(rows) + 1) * ldp;
    float *x = malloc(sizeof(float) * (size_t)(rows * x_sl));
    uint16_t *ref = malloc(sizeof(uint16_t) * 3 * (size_t)part);
    uint16_t *got = malloc(sizeof(uint16_t) * 3 * (size_t)part);
    int special = 0;
    for (int64_t e = 0; e < rows * x_sl; e++) {
        x[e] = split_value(kind);
        special |= e % x_sl < n && split_special(x[e]);
    }
    for (int64_t e = 0; e < 3 * part; e++) ref[e] = got[e] = 0xbeef;
    const int flag = attnx_split_rows_scalar(x, x_sl, rows, n, ref, part, ldp);
    cur.cases++;
    expect(flag == special, "flag %d, want %d", flag, special);
    if (kt) {
        cur.cases++;
        expect(kt->split_rows(x, x_sl, rows, n, got, part, ldp) == special, "flag, want %d",
               special);
        for (int64_t e = 0; e < 3 * part; e++)
            if (!expect(got[e] == ref[e], "part %d row %d col %d: %04x, scalar %04x",
                        (int)(e / part), (int)(e % part / ldp), (int)(e % ldp), got[e], ref[e]))
                break;
    }
    for (int j = 0; j <= ATTNX_ROUND16(rows); j++)
        for (int64_t d = 0; d < ldp; d++) {
            float p[3];
            parts_of(ref, part, j * ldp + d, p);
            if (j == ATTNX_ROUND16(rows) ||
                d >= width) { /* the guard row, the columns past width */
                for (int a = 0; a < 3; a++)
                    expect(ref[a * part + j * ldp + d] == 0xbeef, "row %d col %d written", j,
                           (int)d);
                continue;
            }
            if (j >= rows || d >= n) {
                expect(p[0] == 0 && p[1] == 0 && p[2] == 0, "padding [%d][%d] not 0", j, (int)d);
                continue;
            }
            const float v = x[j * x_sl + d];
            if (split_special(v) || fabsf(v) < 0x1p-100f) continue;
            const double x1 = p[0], x2 = p[1], x3 = p[2];
            cur.cases++;
            expect(x1 + x2 + x3 == (double)v, "%a != %a + %a + %a", v, x1, x2, x3);
            expect(fabs(v - x1) <= ldexp(1.0, ilogb(v) - 8), "x1 = %a not %a to 8 bits", x1, v);
            expect(fabs(x2) <= 0x1p-8 * (1 + 0x1p-8) * fabs(v) && fabs(x3) <= 0x1p-16 * fabs(v),
                   "parts of %a too large: %a %a", v, x2, x3);
        }
    free(x), free(ref), free(got);
}

/* xt (n, LDQ) split into pairs (3, part) by the reference: the rows' split
 * of each column, two dims a word; then by kt (NULL: the reference alone). */
static void split_pairs_case(const attnx_kernels *kt, int nx, int n, int kind)
{
    const int64_t np = (n + 31) / 32 * 32, part = (np / 2 + 1) * LDQ;
    float *xt = malloc(sizeof(float) * (size_t)(n * LDQ)), *col = malloc(sizeof(float) * np);
    uint32_t *ref = malloc(sizeof(uint32_t) * 3 * (size_t)part);
    uint32_t *got = malloc(sizeof(uint32_t) * 3 * (size_t)part);
    uint16_t *rows = malloc(sizeof(uint16_t) * 3 * 16 * (size_t)np);
    int special = 0;
    for (int d = 0; d < n; d++)
        for (int i = 0; i < LDQ; i++) {
            xt[d * LDQ + i] = i < ATTNX_ROUND16(nx) ? split_value(kind) : NAN; /* never read */
            special |= i < ATTNX_ROUND16(nx) && split_special(xt[d * LDQ + i]);
        }
    for (int64_t e = 0; e < 3 * part; e++) ref[e] = got[e] = 0xdeadbeefu;
    cur.cases++;
    expect(attnx_split_pairs_scalar(xt, LDQ, nx, n, np, ref, part) == special, "flag, want %d",
           special);
    for (int i = 0; i < LDQ; i++) { /* column i as a row, split by split_rows */
        for (int d = 0; d < n; d++) col[d] = xt[d * LDQ + i];
        attnx_split_rows_scalar(col, np, 1, n, rows, 16 * np, np);
        for (int64_t p = 0; p <= np / 2; p++)
            for (int a = 0; a < 3; a++) {
                const uint32_t want =
                    p == np / 2 || i >= ATTNX_ROUND16(nx)
                        ? 0xdeadbeefu
                        : rows[a * 16 * np + 2 * p] | (uint32_t)rows[a * 16 * np + 2 * p + 1] << 16;
                expect(ref[a * part + p * LDQ + i] == want, "pair %d of column %d: %08x, want %08x",
                       (int)p, i, ref[a * part + p * LDQ + i], want);
            }
    }
    if (kt) {
        cur.cases++;
        expect(kt->split_pairs(xt, LDQ, nx, n, np, got, part) == special, "flag, want %d", special);
        for (int64_t e = 0; e < 3 * part; e++)
            if (!expect(got[e] == ref[e], "word %d: %08x, scalar %08x", (int)e, got[e], ref[e]))
                break;
    }
    free(xt), free(col), free(ref), free(got), free(rows);
}

static void test_split_reference(void)
{
    begin("any", "split reference", "identical");
    for (int kind = 0; kind < 3; kind++)
        for (int n = 1; n <= 70; n += 1 + n / 8) {
            split_rows_case(NULL, 1 + n % 19, n, n + n % 3, kind);
            split_pairs_case(NULL, 1 + n % LDQ, n, kind);
        }
    end();
    begin("any", "split reference steps", "identical");
    const float x[12] = {
        1.0f + 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-9f, 0x1p99f,   0x1p100f, INFINITY, NAN, 0.0f, -0.0f,
        -0x1p-80f,      0x1.fffffep-81f,          0x1p-126f, 0x1p-149f};
    /* the flag: 2^100 and more, inf, NaN, and 0 < |x| < 2^-80 (subnormals too) */
    const int flagged[12] = {0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1};
    uint16_t parts[3 * 16 * 32];
    const int64_t part = 16 * 32;
    /* 1 + 2^-8 is a tie at 8 bits: to even, 1; then 2^-8 exactly */
    attnx_split_rows_scalar(x, 1, 1, 1, parts, part, 32);
    cur.cases++;
    expect(parts[0] == 0x3f80u && parts[part] == 0x3b80u && parts[2 * part] == 0,
           "1 + 2^-8: %04x %04x %04x", parts[0], parts[part], parts[2 * part]);
    /* 1 + 2^-8 + 2^-9 rounds up to 1 + 2^-7, the rest -2^-9 */
    attnx_split_rows_scalar(x + 1, 1, 1, 1, parts, part, 32);
    expect(parts[0] == 0x3f81u && parts[part] == 0xbb00u && parts[2 * part] == 0,
           "1 + 2^-8 + 2^-9: %04x %04x %04x", parts[0], parts[part], parts[2 * part]);
    for (int e = 2; e < 12; e++) {
        cur.cases++;
        expect(attnx_split_rows_scalar(x + e, 1, 1, 1, parts, part, 32) == flagged[e], "%a: flag",
               x[e]);
    }
    end();
}

/* One tile of qk_split: q (nq, D) and k (nk, D) of kind, split by the
 * reference; kt's scores against the reference's, and the reference
 * against the exact float64 sum. */
static void qk_split_case(const attnx_kernels *kt, int nq, int nk, int D, int kind)
{
    const int64_t dp = (D + 31) / 32 * 32, nk16 = ATTNX_ROUND16(nk), kpart = nk16 * dp;
    const int64_t qpart = dp / 2 * LDQ;
    float *q = malloc(sizeof(float) * (size_t)(nq * D)),
          *k = malloc(sizeof(float) * (size_t)(nk * D));
    float *qt = calloc((size_t)(D * LDQ), sizeof(float));
    uint32_t *qp = malloc(sizeof(uint32_t) * 3 * (size_t)qpart);
    uint16_t *kp = malloc(sizeof(uint16_t) * 3 * (size_t)kpart);
    float *st = guarded((size_t)(nk16 + 1) * LDQ), *ref = guarded((size_t)(nk16 + 1) * LDQ);
    for (int e = 0; e < nq * D; e++)
        q[e] = kind ? (float)ldexp(nrand(), (int)(urand() * 60) - 30) : nrand();
    for (int e = 0; e < nk * D; e++)
        k[e] = kind ? (float)ldexp(nrand(), (int)(urand() * 60) - 30) : nrand();
    for (int i = 0; i < nq; i++)
        for (int d = 0; d < D; d++) qt[d * LDQ + i] = q[i * D + d];
    attnx_split_pairs_scalar(qt, LDQ, nq, D, dp, qp, qpart);
    attnx_split_rows_scalar(k, D, nk, D, kp, kpart, dp);
    kt->qk_split(qp, LDQ, nq, kp, kpart, nk, dp, st);
    attnx_qk_split_scalar(qp, LDQ, nq, kp, kpart, nk, dp, ref);
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < nq; i++) {
            double exact = 0.0, mag = 0.0;
            for (int d = 0; d < D; d++) {
                exact += (double)q[i * D + d] * k[j * D + d];
                mag += fabs((double)q[i * D + d] * k[j * D + d]);
            }
            cur.cases++;
            expect_within(ref[j * LDQ + i], (float)exact, 0x1p-22 * mag + 0x1p-24 * fabs(exact),
                          "reference", j, i);
            /* 6 D terms summed in float32, each step within 2^-24 (no part
             * here is below 2^-126: nothing flushed). With D = 1 the bound is
             * 2^-21 |q·k|: a product left out (q2·k2 is near 2^-18) shows. */
            expect_within(st[j * LDQ + i], ref[j * LDQ + i], (6 * D + 2) * 0x1p-24 * mag, "st", j,
                          i);
        }
    for (int i = 0; i < LDQ; i++) {
        for (int j = 0; j < nk16; j++)
            if (i >= ATTNX_ROUND16(nq))
                expect(st[j * LDQ + i] == GUARD, "st[%d][%d] written past the queries", j, i);
        expect(st[nk16 * LDQ + i] == GUARD, "st row %d written past round16(nk)", (int)nk16);
    }
    free(q), free(k), free(qt), free(qp), free(kp), free(st), free(ref);
}

/* One tile of pv_split: probabilities pt (nk, LDQ) (as the softmax leaves
 * them), values v (nk, Dv) of kind split and transposed by the reference
 * into vt (3, Dv, ldv) with finite junk past nk (read, weighed by 0): kt's
 * acct against the reference's, and the reference against the exact sum. */
static void pv_split_case(const attnx_kernels *kt, int nq, int nk, int Dv, int kind, int with_alpha)
{
    const int64_t ldv = (nk + 31) / 32 * 32 + 32, vpart = (int64_t)Dv * ldv;
    float *pt = malloc(sizeof(float) * (size_t)nk * LDQ),
          *vtf = malloc(sizeof(float) * (size_t)(Dv * ldv));
    uint16_t *vt = malloc(sizeof(uint16_t) * 3 * (size_t)vpart);
    float *acct = guarded((size_t)(Dv + 1) * LDQ), *ref = guarded((size_t)(Dv + 1) * LDQ);
    float *init = guarded((size_t)Dv * LDQ), alpha[LDQ];
    float *work = attnx_os_aligned_alloc(sizeof(float) * ATTNX_PV_BF16_WORK(0));
    for (int j = 0; j < nk; j++)
        for (int i = 0; i < LDQ; i++) pt[j * LDQ + i] = random_prob();
    for (int d = 0; d < Dv; d++)
        for (int64_t j = 0; j < ldv; j++)
            vtf[d * ldv + j] = kind ? (float)ldexp(nrand(), (int)(urand() * 60) - 30) : nrand();
    attnx_split_rows_scalar(vtf, ldv, Dv, ldv, vt, vpart, ldv);
    for (int d = 0; d < Dv; d++)
        for (int i = 0; i < ATTNX_ROUND16(nq); i++)
            init[d * LDQ + i] = acct[d * LDQ + i] = ref[d * LDQ + i] = nrand();
    for (int i = 0; i < LDQ; i++) alpha[i] = (float)urand();
    const float *al = with_alpha ? alpha : NULL;
    kt->pv_split(pt, LDQ, nq, vt, ldv, vpart, nk, Dv, al, acct, work);
    attnx_pv_split_scalar(pt, LDQ, nq, vt, ldv, vpart, nk, Dv, al, ref);
    for (int d = 0; d < Dv; d++)
        for (int i = 0; i < nq; i++) {
            const float a = al ? al[i] * init[d * LDQ + i] : init[d * LDQ + i];
            double exact = a, mag = fabs(a);
            for (int j = 0; j < nk; j++) {
                exact += (double)pt[j * LDQ + i] * vtf[d * ldv + j];
                mag += fabs((double)pt[j * LDQ + i] * vtf[d * ldv + j]);
            }
            cur.cases++;
            expect_within(ref[d * LDQ + i], (float)exact, 0x1p-22 * mag + 0x1p-24 * fabs(exact),
                          "reference", d, i);
            /* 6 nk terms and the start, summed in float32 (nothing here is
             * flushed but parts of probabilities below 2^-110: they are 0
             * against a start of order 1) */
            expect_within(acct[d * LDQ + i], ref[d * LDQ + i], (6 * nk + 2) * 0x1p-24 * mag, "acct",
                          d, i);
        }
    for (int d = 0; d < Dv; d++)
        for (int i = ATTNX_ROUND16(nq); i < LDQ; i++)
            expect(acct[d * LDQ + i] == GUARD, "acct[%d][%d] written past the queries", d, i);
    for (int i = 0; i < LDQ; i++)
        expect(acct[Dv * LDQ + i] == GUARD, "acct row %d (Dv) written", Dv);
    free(pt), free(vtf), free(vt), free(acct), free(ref), free(init);
    attnx_os_aligned_free(work);
}

/* Every table of an instruction set's bfloat16 dot products that has the
 * split, on this CPU: its splits give the reference's bits, and its
 * qk_split is within the summation bound, over 1 and 2 tiles of keys and
 * queries, partial ones, and dims around 32. */
static void test_split(const char *isa)
{
    static const int dims[] = {1, 24, 32, 47, 64, 70, 96, 128};
    static const int keys[] = {1, 15, 16, 17, 31, 32, 33, 64, 100, 128};
    const attnx_isa *row = isa_row(isa);
    for (const attnx_dots *dots = row && row->dots ? row->dots : NULL; dots && dots->name; dots++) {
        const attnx_kernels *kt = dots->kernels;
        if (!kt->qk_split || !dots->supported()) continue;
        char what[64];
        snprintf(what, sizeof what, "split %s", dots->name);
        begin(isa, what, "identical");
        for (int kind = 0; kind < 3; kind++)
            for (int n = 1; n <= 130; n += 1 + n / 6) {
                split_rows_case(kt, 1 + n % 37, n, n + n % 3, kind);
                split_pairs_case(kt, 1 + (n * 7) % LDQ, n, kind);
            }
        end();
        snprintf(what, sizeof what, "qk_split %s", dots->name);
        begin(isa, what, "summation");
        for (int kind = 0; kind < 2; kind++)
            for (int a = 0; a < SMAX + NWIDE; a++)
                for (int x = 0; x < 8; x++)
                    for (int y = (a + x) % 3; y < 10; y += 3)
                        qk_split_case(kt, size_at(a) > LDQ ? LDQ : size_at(a), keys[y], dims[x],
                                      kind);
        end();
        snprintf(what, sizeof what, "pv_split %s", dots->name);
        begin(isa, what, "summation");
        for (int kind = 0; kind < 2; kind++)
            for (int a = 0; a < SMAX + NWIDE; a++)
                for (int x = 0; x < 6; x++)
                    for (int y = (a + x) % 3; y < 10; y += 3)
                        pv_split_case(kt, size_at(a) > LDQ ? LDQ : size_at(a), keys[y],
                                      16 * (1 + x % 3) * (1 + x / 3), kind, (a + x + y) % 3 != 0);
        end();
    }
}

/* ---- fma_burn ---------------------------------------------------------------------- */

/* The peak's kernel counts its flops right (a lane's FMA is 2) and computes
 * the chains the scalar one does: x ← x·b + c from x = chain number, the
 * same sum of chains, within float32's rounding of that many steps. */
static void test_fma_burn(const char *isa, const attnx_kernels *kt)
{
    begin(isa, "fma_burn", "flops exact, value 1e-5");
    float sink;
    const double width = kt->fma_burn(1, &sink) / (ATTNX_PEAK_CHAINS * 2); /* lanes a vector */
    expect(width == 4 || width == 8 || width == 16, "%g lanes a vector", width);
    for (int64_t rounds = 0; rounds <= 1000; rounds += 333) {
        float got = GUARD, want = GUARD;
        const double flops = kt->fma_burn(rounds, &got);
        attnx_kernels_scalar.fma_burn(rounds, &want);
        cur.cases++;
        expect(flops == (double)rounds * ATTNX_PEAK_CHAINS * width * 2, "%g flops for %lld rounds",
               flops, (long long)rounds);
        expect_within(got, want, 1e-5 * fabs(want) + 1e-6, "sink", (int)rounds, 0);
    }
    end();
}

/* ---- round_rows, round_pairs: "medium" for inputs that are not bfloat16 ------------------
 * The references first: round_rows gives attnx_bf16_round's bits and zeros
 * past n, and says whether a finite value became inf; round_pairs is
 * attnx_pack_qt_bf16_rounded of the rows it was transposed from (pack_qt's
 * scalar kernel at scale 1). Then each kernel of the instruction set's
 * bfloat16 dot products gives its reference's bits and flag, and writes
 * nothing past its rows (guards). Values of every kind: random bits, ties,
 * values near bfloat16's largest (some round to inf), inf, NaN, subnormals. */
static float round_value(int kind)
{
    uint32_t u = (uint32_t)(urand() * 4294967296.0);
    if (kind == 0) return (float)(nrand() * ldexp(1.0, (int)(urand() * 20) - 10));
    if (kind == 1) u = (u & 0xffff0000u) | 0x8000u;                          /* a tie */
    if (kind == 2) u = (u & 0x80000000u) | 0x7f7f0000u | (u & 0xffffu);      /* near the top */
    if (kind == 3 && urand() < 0.5) u = (u & 0x80000000u) | (u & 0x7fffffu); /* subnormal */
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static void test_round(const char *isa)
{
    const int is_ref = isa == NULL;
    const attnx_isa *row = is_ref ? NULL : isa_row(isa);
    const attnx_dots *dots = row && row->dots ? row->dots : NULL;
    for (;;) {
        int (*rows_fn)(const float *, int64_t, int, int64_t, uint16_t *, int64_t) =
            attnx_round_rows_scalar;
        void (*pairs_fn)(float *, int64_t, int, int64_t) = attnx_round_pairs_scalar;
        char what[64] = "round_rows, round_pairs";
        if (!is_ref) {
            if (!dots || !dots->name) return;
            const attnx_dots *d = dots++;
            if (!d->supported() || !d->kernels->round_rows) continue;
            rows_fn = d->kernels->round_rows;
            pairs_fn = d->kernels->round_pairs;
            snprintf(what, sizeof what, "round %s", d->name);
        }
        begin(is_ref ? "any" : isa, what, "identical");
        for (int kind = 0; kind < 4; kind++)
            for (int rows = 1; rows <= 19; rows += 6)
                for (int n = 1; n <= 70; n += (n < 34 ? 1 : 9)) {
                    const int64_t x_sl = n + 3, ld = n + (n % 3) * 5;
                    float *x = guarded((size_t)(rows * x_sl));
                    uint16_t *got = calloc((size_t)(rows * ld + 8), 2);
                    int over = 0;
                    for (int e = 0; e < rows * x_sl; e++) x[e] = round_value(kind);
                    for (int e = 0; e < rows * ld + 8; e++) got[e] = 0xbeef;
                    const int flag = rows_fn(x, x_sl, rows, n, got, ld);
                    cur.cases++;
                    for (int j = 0; j < rows; j++)
                        for (int d = 0; d < ld; d++) {
                            const uint16_t want = d < n ? attnx_bf16_round(x[j * x_sl + d]) : 0;
                            over |=
                                d < n && isfinite(x[j * x_sl + d]) && !isfinite(bf16_value(want));
                            expect(got[j * ld + d] == want, "row %d dim %d: %04x, want %04x", j, d,
                                   got[j * ld + d], want);
                        }
                    for (int e = rows * (int)ld; e < rows * (int)ld + 8; e++)
                        expect(got[e] == 0xbeef, "wrote past the rows at %d", e);
                    expect(!flag == !over, "flag %d, want %d", flag, over);
                    free(x);
                    free(got);
                    /* the queries of the same values, transposed as pack_qt does */
                    const int nq = rows, D = n;
                    float *xt = guarded((size_t)D * LDQ);
                    uint32_t *want = malloc(sizeof(uint32_t) * (size_t)((D + 1) / 2) * LDQ);
                    float *q = guarded((size_t)(nq * D));
                    for (int e = 0; e < nq * D; e++) q[e] = round_value(kind);
                    attnx_kernels_scalar.pack_qt(q, D, nq, D, 1.0f, xt, LDQ);
                    attnx_pack_qt_bf16_rounded(q, D, nq, D, want, LDQ);
                    pairs_fn(xt, LDQ, nq, D);
                    const uint32_t *pairs = (const uint32_t *)(void *)xt;
                    for (int pp = 0; pp < (D + 1) / 2; pp++)
                        for (int i = 0; i < ATTNX_ROUND16(nq); i++)
                            expect(pairs[pp * LDQ + i] == want[pp * LDQ + i],
                                   "pair %d query %d: %08x, want %08x", pp, i, pairs[pp * LDQ + i],
                                   want[pp * LDQ + i]);
                    free(xt);
                    free(want);
                    free(q);
                }
        end();
        if (is_ref) return;
    }
}

/* ---- qk_dot_medium, pv_rows_medium: decoding under "medium" -------------------------------
 * The references first, on ordinary values: within the summation bound of
 * the float64 sum of their rounded products (the products are exact), the
 * scales applied as the contract says. Then each kernel of the instruction
 * set's bfloat16 dot products gives its reference's bits (vdpbf16ps), for
 * bfloat16 and float16 rows of any bits (inf, NaN, subnormals) and int8
 * rows, query rows 1 .. 9, keys past a tile (pv), dims not a multiple of 32
 * (qk), with and without the rescale, and writes nothing past its rows
 * (guards). AMX's tiles sum their own way: within the references' bound on
 * ordinary values, over whole and partial blocks of 16 and 32 keys, and the
 * reference's bits where a NaN is planted where they would read it (they
 * leave such a call to vdpbf16ps). */
typedef struct {
    int kind, nq, nk, D, Dv, special;
    int64_t k_sl;
    uint32_t *qp; /* (nq, ldp) */
    int64_t ldp;
    void *k;      /* (nk, k_sl) bf16 or int8: keys, and values (Dv <= k_sl) */
    float *scale; /* (nk) 2 apart, int8 only */
    float *pt;    /* (nq, ldk) */
    int64_t ldk;
} medium_rows_case;

static medium_rows_case medium_rows_make(int kind, int nq, int nk, int D, int Dv, int special)
{
    medium_rows_case c = {kind, nq, nk, D, Dv, special, 0, NULL, 0, NULL, NULL, NULL, 0};
    c.k_sl = (D > Dv ? D : Dv) + 3;
    c.ldp = (D + 31) / 32 * 16 + 5;
    c.ldk = nk + 7;
    c.qp = calloc((size_t)(nq * c.ldp), sizeof(uint32_t));
    for (int i = 0; i < nq; i++)
        for (int d = 0; d < D; d++) {
            const uint16_t h = special ? random_bf16(1) : small_half(ATTNX_HALF_BF16);
            c.qp[i * c.ldp + d / 2] |= (uint32_t)h << (16 * (d % 2));
        }
    const size_t n = (size_t)(nk * c.k_sl);
    if (kind == ATTNX_MEDIUM_I8) {
        int8_t *k = malloc(n);
        for (size_t e = 0; e < n; e++) k[e] = (int8_t)(int)(urand() * 256.0 - 128.0);
        c.k = k;
        c.scale = malloc(sizeof(float) * (size_t)(2 * nk + 1));
        for (int j = 0; j < 2 * nk + 1; j++) c.scale[j] = (float)(urand() * 0.05 + 1e-3);
    } else { /* 16-bit rows: any bits (special), or small values */
        const int f16 = kind == ATTNX_MEDIUM_F16;
        uint16_t *k = malloc(2 * n);
        for (size_t e = 0; e < n; e++)
            k[e] = special ? (f16 ? random_half() : random_bf16(1))
                           : small_half(f16 ? ATTNX_HALF_F16 : ATTNX_HALF_BF16);
        c.k = k;
    }
    c.pt = malloc(sizeof(float) * (size_t)(nq * c.ldk));
    for (int e = 0; e < nq * c.ldk; e++) c.pt[e] = random_prob();
    return c;
}

static void medium_rows_free(medium_rows_case *c)
{
    free(c->qp);
    free(c->k);
    free(c->scale);
    free(c->pt);
}

/* Element e of row j of the case's keys or values, as the kernels take it
 * (a float16 value rounded to bfloat16), as a double. */
static double medium_rows_at(const medium_rows_case *c, int j, int e)
{
    if (c->kind == ATTNX_MEDIUM_I8) return (double)((const int8_t *)c->k)[j * c->k_sl + e];
    const uint16_t h = ((const uint16_t *)c->k)[j * c->k_sl + e];
    return bf16_value(c->kind == ATTNX_MEDIUM_F16 ? attnx_bf16_round(attnx_half_to_float(h)) : h);
}

/* kt's kernels (NULL: the references) on ordinary values: within the
 * summation bound of the float64 sum of their rounded products (exact), the
 * scales applied as the contract says, from alpha (with_alpha) times the
 * accumulator; nothing written past st's keys or acc's dims. qk, pv: which
 * of the two to check. */
static void medium_rows_bound(const attnx_kernels *kt, const medium_rows_case *c, int with_alpha,
                              int qk, int pv)
{
    const float scale = 0.125f;
    if (qk) {
        float *st = guarded((size_t)(c->nq * c->ldk));
        (kt ? kt->qk_dot_medium : attnx_qk_dot_medium_scalar)(c->kind, c->qp, c->ldp, c->nq, c->k,
                                                              c->k_sl, c->scale, 2, c->nk, c->D,
                                                              scale, st, c->ldk);
        cur.cases++;
        for (int i = 0; i < c->nq; i++)
            for (int j = 0; j < c->ldk; j++) {
                if (j >= c->nk) {
                    expect(st[i * c->ldk + j] == GUARD, "st[%d][%d] written past the keys", i, j);
                    continue;
                }
                double sum = 0.0, abs = 0.0;
                for (int d = 0; d < c->D; d++) {
                    const double t =
                        bf16_value((uint16_t)(c->qp[i * c->ldp + d / 2] >> (16 * (d % 2)))) *
                        medium_rows_at(c, j, d);
                    sum += t;
                    abs += fabs(t);
                }
                const double f = c->scale ? (double)(scale * c->scale[2 * j]) : scale;
                expect_within(st[i * c->ldk + j], (float)(sum * f),
                              ((c->D + 4) * 0x1p-23 * abs + 0x1p-100) * f, "st", i, j);
            }
        free(st);
    }
    if (!pv) return;
    const int64_t ldacc = c->Dv + 16;
    const size_t n = (size_t)(c->nq * ldacc);
    float *acc = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n), alpha[16];
    for (size_t e = 0; e < n; e++) acc[e] = (int64_t)e % ldacc < c->Dv ? nrand() : GUARD;
    for (int i = 0; i < 16; i++) alpha[i] = with_alpha ? (float)urand() : 1.0f;
    memcpy(got, acc, sizeof(float) * n);
    (kt ? kt->pv_rows_medium : attnx_pv_rows_medium_scalar)(c->kind, c->pt, c->ldk, c->nq, c->k,
                                                            c->k_sl, c->scale, 2, c->nk, c->Dv,
                                                            with_alpha ? alpha : NULL, got, ldacc);
    cur.cases++;
    for (int i = 0; i < c->nq; i++)
        for (int64_t d = 0; d < ldacc; d++) {
            if (d >= c->Dv) {
                expect(got[i * ldacc + d] == GUARD, "acc[%d][%d] written past Dv", i, (int)d);
                continue;
            }
            double sum = (double)(acc[i * ldacc + d] * alpha[i]), abs = fabs(sum);
            for (int j = 0; j < c->nk; j++) {
                const float p =
                    c->scale ? c->pt[i * c->ldk + j] * c->scale[2 * j] : c->pt[i * c->ldk + j];
                const double t = bf16_value(attnx_bf16_round(p)) * medium_rows_at(c, j, (int)d);
                sum += t;
                abs += fabs(t);
            }
            expect_within(got[i * ldacc + d], (float)sum,
                          (c->nk + 4) * 0x1p-23 * abs + c->nk * 0x1p-120, "acc", i, (int)d);
        }
    free(acc);
    free(got);
}

/* kt's kernels against the references: the same bits, guards past the
 * keys (st) and dims (acc) compared too. qk, pv: which of the two to compare. */
static void medium_rows_compare(const attnx_kernels *kt, const medium_rows_case *c, int with_alpha,
                                int qk, int pv)
{
    const float scale = 0.0883883f;
    if (qk) {
        float *st = guarded((size_t)(c->nq * c->ldk)), *ref = guarded((size_t)(c->nq * c->ldk));
        kt->qk_dot_medium(c->kind, c->qp, c->ldp, c->nq, c->k, c->k_sl, c->scale, 2, c->nk, c->D,
                          scale, st, c->ldk);
        attnx_qk_dot_medium_scalar(c->kind, c->qp, c->ldp, c->nq, c->k, c->k_sl, c->scale, 2, c->nk,
                                   c->D, scale, ref, c->ldk);
        cur.cases++;
        for (int e = 0; e < c->nq * c->ldk; e++) /* guards past nk compared too */
            expect_same(st[e], ref[e], "st", e / (int)c->ldk, e % (int)c->ldk);
        free(st);
        free(ref);
    }
    if (!pv) return;
    const int64_t ldacc = c->Dv + 16;
    float *acc = malloc(sizeof(float) * (size_t)(c->nq * ldacc)), alpha[16];
    for (int e = 0; e < c->nq * ldacc; e++) acc[e] = (e % ldacc) < c->Dv ? nrand() : GUARD;
    for (int i = 0; i < 16; i++) alpha[i] = (float)urand();
    float *want = malloc(sizeof(float) * (size_t)(c->nq * ldacc));
    memcpy(want, acc, sizeof(float) * (size_t)(c->nq * ldacc));
    const float *al = with_alpha ? alpha : NULL;
    kt->pv_rows_medium(c->kind, c->pt, c->ldk, c->nq, c->k, c->k_sl, c->scale, 2, c->nk, c->Dv, al,
                       acc, ldacc);
    attnx_pv_rows_medium_scalar(c->kind, c->pt, c->ldk, c->nq, c->k, c->k_sl, c->scale, 2, c->nk,
                                c->Dv, al, want, ldacc);
    cur.cases++;
    for (int e = 0; e < c->nq * ldacc; e++)
        expect_same(acc[e], want[e], "acc", e / (int)ldacc, e % (int)ldacc);
    free(acc);
    free(want);
}

/* A NaN where AMX's tiles would read it, so that they leave the call to
 * vdpbf16ps (its bits): a key (and value) among the keys the score tiles
 * take, or for int8 rows (never NaN) a query's. */
static void medium_rows_plant_nan(medium_rows_case *c)
{
    if (c->kind == ATTNX_MEDIUM_I8) {
        c->qp[0] = (c->qp[0] & 0xffff0000u) | 0x7fc0u;
        return;
    }
    const int keys = c->nk >= 16 ? c->nk / 16 * 16 : c->nk, dims = c->D < c->Dv ? c->D : c->Dv;
    ((uint16_t *)c->k)[(int)(urand() * keys) * c->k_sl + (int)(urand() * dims)] =
        c->kind == ATTNX_MEDIUM_F16 ? 0x7e00u : 0x7fc0u;
}

/* The groups of a "medium" kernel test, one a call: isa NULL, the reference
 * once (*kt NULL); else each of the ISA's bfloat16 dot products that runs
 * here and has the kernel (has). begin()s the group named after `kernel`;
 * returns 0 when none is left. *dots: the state, NULL on the first call.
 * *identical: whether the group's kernel gives the reference's bits (with
 * tiles_differ, not on a table whose dot products sum their own way: AMX's
 * tiles; the reference's group: 0). */
static int next_medium_group(const char *isa, const char *kernel, int (*has)(const attnx_kernels *),
                             int tiles_differ, const attnx_dots **dots, const attnx_kernels **kt,
                             int *identical)
{
    static const attnx_dots done = {0};
    static char what[64]; /* begin() keeps the name until end() */
    if (!isa) {
        if (*dots) return 0;
        *dots = &done, *kt = NULL, *identical = 0;
        snprintf(what, sizeof what, "%s reference", kernel);
        begin("any", what, "summation");
        return 1;
    }
    if (!*dots) {
        const attnx_isa *row = isa_row(isa);
        *dots = row && row->dots ? row->dots : &done;
    }
    for (const attnx_dots *d; (d = *dots)->name;) {
        ++*dots;
        if (!d->supported() || !has(d->kernels)) continue;
        *kt = d->kernels, *identical = !tiles_differ || d->same_bits;
        snprintf(what, sizeof what, "%s %s", kernel, d->name);
        begin(isa, what, *identical ? "identical" : "summation");
        return 1;
    }
    return 0;
}

static int has_medium_rows(const attnx_kernels *kt) { return kt->qk_dot_medium != NULL; }
static int has_ptx_medium(const attnx_kernels *kt) { return kt->ptx_medium != NULL; }

/* isa NULL: the references; else each of its bfloat16 dot products'. */
static void test_medium_rows(const char *isa)
{
    const attnx_dots *dots = NULL;
    const attnx_kernels *kt;
    int identical;
    while (next_medium_group(isa, "medium rows", has_medium_rows, 1, &dots, &kt, &identical)) {
        for (int kind = ATTNX_MEDIUM_BF16; kind <= ATTNX_MEDIUM_F16; kind++)
            for (int nq = 1; nq <= 9; nq += 2)
                for (int nk = 1; nk <= 300; nk += (nk < 12 ? 1 : 47))
                    for (int D = 1; D <= 130; D += (D < 40 ? 13 : 31)) {
                        const int Dv = 32 * (1 + (nk + D) % 4);
                        for (int special = 0; special < (isa ? 2 : 1); special++) {
                            medium_rows_case c = medium_rows_make(kind, nq, nk, D, Dv, special);
                            const int alpha = (nk + nq) % 2;
                            if (!isa) {
                                medium_rows_bound(NULL, &c, 1, 1, 1);
                            } else if (identical) {
                                medium_rows_compare(kt, &c, alpha, 1, 1);
                            } else if (!special) { /* tiles: their own order of the sums */
                                medium_rows_bound(kt, &c, alpha, 1, 1);
                            } else { /* tiles: vdpbf16ps's bits (int8 values: no NaN,
                                        so P·V on the tiles, within the bound) */
                                medium_rows_plant_nan(&c);
                                const int i8 = kind == ATTNX_MEDIUM_I8;
                                medium_rows_compare(kt, &c, alpha, 1, !i8);
                                if (i8) medium_rows_bound(kt, &c, alpha, 0, 1);
                            }
                            medium_rows_free(&c);
                        }
                    }
        end();
    }
}

/* ---- the backward's ptx under "medium": ptx_medium ---------------------------------
 * The reference within the summation bound of the float64 sum of its
 * products (bfloat16 subnormals read as 0), onto the accumulator; each table's
 * kernel with the reference's bits (vdpbf16ps), or within the same bound
 * (AMX's tiles, over whole and partial blocks of 16 keys, 16 dims and 32
 * queries) and the reference's bits where the case holds an inf or NaN (a
 * NaN planted in the keys the tiles take: they leave such a call to
 * vdpbf16ps; huge finite values summed in another order may overflow to
 * another inf or NaN, so any bits are not compared on tiles); the accumulator's
 * columns past n and its row past nk untouched, and the tile's columns past
 * nq + 1 (NaN) never read. */
typedef struct {
    int nq, nk, n;
    int64_t ldp, ldx, ldacc;
    uint16_t *pp;
    uint32_t *xp;
    float *acc; /* (nk + 1, ldacc): the accumulator, then a guard row */
} ptx_medium_case;

/* A value of random_bf16's kind 0 or 1, or (kind 2) of kind 0 with subnormals among them. */
static uint16_t ptx_medium_value(int kind)
{
    return random_bf16(kind == 2 ? (urand() < 0.1 ? 2 : 0) : kind);
}

static ptx_medium_case ptx_medium_make(int nq, int nk, int n, int kind)
{
    ptx_medium_case c = {nq,   nk,   n,   nq + 2 + (nq & 1), ATTNX_ROUND16(n) + 16, n + 5,
                         NULL, NULL, NULL};
    const int pairs = (nq + 1) / 2;
    c.pp = malloc(sizeof(uint16_t) * (size_t)(nk * c.ldp));
    c.xp = malloc(sizeof(uint32_t) * (size_t)(pairs * c.ldx));
    c.acc = guarded((size_t)((nk + 1) * c.ldacc));
    for (int j = 0; j < nk; j++)
        for (int64_t i = 0; i < c.ldp; i++) /* past nq: 0 (pp[j][nq] of an odd nq), then NaN */
            c.pp[j * c.ldp + i] = i < nq ? ptx_medium_value(kind) : i == nq ? 0 : 0x7fc1u;
    for (int m = 0; m < pairs; m++)
        for (int64_t e = 0; e < c.ldx; e++) {
            const uint32_t odd = 2 * m + 1 < nq ? ptx_medium_value(kind) : 0u;
            c.xp[m * c.ldx + e] = e < n ? ptx_medium_value(kind) | odd << 16 : 0x7fc17fc1u;
        }
    for (int j = 0; j < nk; j++)
        for (int e = 0; e < n; e++) c.acc[j * c.ldacc + e] = nrand();
    return c;
}

static void ptx_medium_free(ptx_medium_case *c) { free(c->pp), free(c->xp), free(c->acc); }

/* The answer `got` (from the accumulator `init`, ordinary values) within
 * the summation bound of the float64 sum, and its guards (past n, the row
 * past nk) init's. */
static void ptx_medium_bound(const ptx_medium_case *c, const float *init, const float *got)
{
    cur.cases++;
    for (int j = 0; j <= c->nk; j++)
        for (int64_t e = 0; e < c->ldacc; e++) {
            const double a = init[j * c->ldacc + e];
            if (j == c->nk || e >= c->n) {
                expect_same(got[j * c->ldacc + e], (float)a, "acc (guard)", j, (int)e);
                continue;
            }
            double sum = 0.0, mag = 0.0;
            for (int i = 0; i < c->nq; i++) {
                const uint32_t w = c->xp[(i / 2) * c->ldx + e];
                const double t = bf16_flushed(c->pp[j * c->ldp + i]) *
                                 bf16_flushed((uint16_t)(i % 2 ? w >> 16 : w));
                sum += t;
                mag += fabs(t);
            }
            /* nq rounded terms from zero (in any order), flushed below 2^-126, then one addition */
            const double bound =
                (c->nq + 1) * 0x1p-23 * mag + (c->nq + 1) * 0x1p-125 + 0x1p-24 * fabs(a + sum);
            expect_within(got[j * c->ldacc + e], (float)(a + sum), bound, "acc", j, (int)e);
        }
}

/* isa NULL: the reference against float64; else each of its bfloat16 dot products'. */
static void test_ptx_medium(const char *isa)
{
    static const int nqs[] = {1, 2, 3, 16, 17, 33, 63, 64};
    static const int ns[] = {1, 15, 16, 17, 40, 64, 65, 127, 128, 130};
    static const int nks[] = {1, 2, 4, 7, 9, 16, 17, 32, 33, 50};
    const attnx_dots *dots = NULL;
    const attnx_kernels *kt;
    int identical;
    while (next_medium_group(isa, "ptx_medium", has_ptx_medium, 1, &dots, &kt, &identical)) {
        for (int kind = 0; kind < 3; kind++)
            for (int a = 0; a < 8; a++)
                for (int y = (a + kind) % 2; y < 10; y += 1 + (a + y) % 3)
                    for (int b = (a + y) % 3; b < 10; b += 2) {
                        if (!isa && kind == 1) continue; /* no inf or NaN for the bound */
                        const int nk = nks[y];
                        ptx_medium_case c = ptx_medium_make(nqs[a], nk, ns[b], kind);
                        if (kind == 1 && !identical) { /* a NaN among the keys the tiles
                                                           would take: vdpbf16ps's bits */
                            const int keys = nk >= 16 ? nk / 16 * 16 : nk;
                            c.pp[(int)(urand() * keys) * c.ldp + (int)(urand() * c.nq)] = 0x7fc0u;
                        }
                        const size_t bytes = sizeof(float) * (size_t)((nk + 1) * c.ldacc);
                        float *init = malloc(bytes), *want = malloc(bytes);
                        memcpy(init, c.acc, bytes);
                        memcpy(want, c.acc, bytes);
                        attnx_ptx_medium_scalar(c.pp, c.ldp, c.nq, c.xp, c.ldx, nk, c.n, want,
                                                c.ldacc);
                        if (!isa) {
                            ptx_medium_bound(&c, init, want);
                        } else {
                            kt->ptx_medium(c.pp, c.ldp, c.nq, c.xp, c.ldx, nk, c.n, c.acc, c.ldacc);
                            if (identical || kind == 1) {
                                cur.cases++; /* the guards past n and the row past nk too */
                                for (int j = 0; j <= nk; j++)
                                    for (int64_t e = 0; e < c.ldacc; e++)
                                        expect_same(c.acc[j * c.ldacc + e], want[j * c.ldacc + e],
                                                    "acc", j, (int)e);
                            } else {
                                ptx_medium_bound(&c, init, c.acc);
                            }
                        }
                        free(init), free(want);
                        ptx_medium_free(&c);
                    }
        end();
    }
}

/* The bfloat16 dot products' and the tiles' peak kernels (each of the
 * instruction set's bfloat16 dot products that run here): flops counted
 * as their contract says, and the exact sums of their chains (every step
 * adds a power of two, so the sums below are exact in float32). */
static void test_dot_burns(const char *isa)
{
    const attnx_isa *row = isa_row(isa);
    for (const attnx_dots *dots = row && row->dots ? row->dots : NULL; dots && dots->name; dots++) {
        const attnx_kernels *kt = dots->kernels;
        if (!dots->supported()) continue;
        char what[64];
        snprintf(what, sizeof what, "dot burns %s", dots->name);
        begin(isa, what, "flops and sums exact");
        expect(kt->bf16dot_burn != NULL, "no bf16dot_burn");
        expect((kt->amx_burn != NULL) == (kt->pv_split != NULL), "amx_burn without the tiles");
        for (int64_t rounds = 0; rounds <= 1000; rounds += 333) {
            float got = GUARD;
            cur.cases++;
            if (kt->bf16dot_burn) {
                const double flops = kt->bf16dot_burn(rounds, &got);
                expect(flops == (double)rounds * ATTNX_PEAK_CHAINS * 16 * 4,
                       "%g flops, %lld rounds", flops, (long long)rounds);
                const float want = (float)(ATTNX_PEAK_CHAINS * (ATTNX_PEAK_CHAINS - 1) / 2) +
                                   (float)(ATTNX_PEAK_CHAINS * rounds) * 0x1p-15f;
                expect_same(got, want, "bf16dot sink", (int)rounds, 0);
            }
            if (kt->amx_burn) {
                got = GUARD;
                const double flops = kt->amx_burn(rounds, &got);
                expect(flops == (double)rounds * 4 * 16384, "%g amx flops, %lld rounds", flops,
                       (long long)rounds);
                expect_same(got, (float)(2 * rounds) * 0x1p-11f, "amx sink", (int)rounds, 0);
            }
        }
        end();
    }
}

/* ---- int8 keys and values with a scale a row: i8_rows the rounded products
 * scale · x (the scalar kernel's bits); qk_dot_i8 the same bits as qk_dot on
 * the int8 values as floats, times the scales after; pv_i8 the same bits as
 * pv on the int8 values with each probability times its row's scale first.
 * Every table, the scalar one included (against its own float kernels). */

static void i8_case(const attnx_kernels *kt, int nq, int nk, int D)
{
    const int64_t sl = D + 3, ssl = 2; /* rows and scales further apart than packed */
    int8_t *x = calloc((size_t)(nk * sl) + 1, 1);
    float *sc = calloc((size_t)(nk * ssl) + 1, sizeof(float)), *raw = guarded((size_t)nk * D + 1);
    float *f = guarded((size_t)nk * D + 1), *ref = guarded((size_t)nk * D + 1);
    for (int64_t e = 0; e < nk * sl; e++)
        x[e] = (int8_t)(e % 7 == 3 ? -128 : (int)(urand() * 255) - 127);
    for (int j = 0; j < nk; j++) {
        sc[j * ssl] = (float)(urand() * 0.05);
        sc[j * ssl + 1] = NAN; /* between the scales: never read */
        for (int d = 0; d < D; d++) raw[j * D + d] = (float)x[j * sl + d];
    }
    kt->i8_rows(x, sl, sc, ssl, nk, D, f);
    attnx_kernels_scalar.i8_rows(x, sl, sc, ssl, nk, D, ref);
    cur.cases++;
    for (int j = 0; j < nk; j++)
        for (int d = 0; d < D; d++) {
            expect_same(f[j * D + d], ref[j * D + d], "i8_rows", j, d);
            expect_same(ref[j * D + d], sc[j * ssl] * raw[j * D + d], "i8_rows (scalar)", j, d);
        }
    expect(f[nk * D] == GUARD, "i8_rows wrote past its rows");
    float *qr = guarded((size_t)nq * D), *st = guarded((size_t)(nq + 1) * LDQ);
    float *st2 = guarded((size_t)(nq + 1) * LDQ);
    for (int e = 0; e < nq * D; e++) qr[e] = nrand();
    kt->qk_dot_i8(qr, D, nq, x, sl, sc, ssl, nk, st, LDQ);
    kt->qk_dot(qr, D, nq, raw, D, nk, st2, LDQ);
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < nk; j++) st2[i * LDQ + j] *= sc[j * ssl];
    compare_tile(st, st2, nk, nq, 1, 1, NULL, "qk_dot_i8");
    /* pv_i8 against pv on the probabilities times the scales; with and without the rescale */
    float *pt = guarded((size_t)(nq + 1) * LDQ);
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < nk; j++) pt[i * LDQ + j] = st2[i * LDQ + j] * sc[j * ssl];
    const int64_t ldacc = D + 2;
    float *acc = guarded((size_t)nq * ldacc + 1), *acc2 = guarded((size_t)nq * ldacc + 1);
    float alpha[ATTNX_ROUND16(4)];
    for (int i = 0; i < nq; i++) alpha[i] = (float)urand();
    for (int rescale = 0; rescale < 2; rescale++) {
        for (int64_t e = 0; e < nq * ldacc; e++) acc[e] = acc2[e] = nrand();
        kt->pv_i8(st2, 1, LDQ, nq, x, sl, sc, ssl, nk, D, rescale ? alpha : NULL, acc, ldacc);
        kt->pv(pt, 1, LDQ, nq, raw, D, nk, D, rescale ? alpha : NULL, acc2, ldacc);
        same_rows(acc, acc2, nq, D, ldacc, "pv_i8");
    }
    free(x), free(sc), free(raw), free(f), free(ref), free(qr), free(st), free(st2), free(pt);
    free(acc), free(acc2);
}

static void test_i8(const char *isa, const attnx_kernels *kt)
{
    begin(isa, "i8_rows, qk_dot_i8, pv_i8", "identical");
    const int max_nq = kt->dot_max_nq > 4 ? kt->dot_max_nq : 4;
    for (int nq = 1; nq <= max_nq; nq++)
        for (int nk = 0; nk <= 9; nk += nk ? 4 : 1) /* nk = 0: pv_i8's rescale alone */
            for (int D = 1; D <= SMAX; D += 3) i8_case(kt, nq, nk, D);
    for (int D = 60; D <= 68; D += 4) i8_case(kt, 2, 13, D);
    end();
}

int main(void)
{
    rng_state = 0x2545F4914F6CDD1Dull; /* this file's seed */
    int tested = 0;
    printf("attnx kernel test: each instruction set's kernels against the scalar ones\n");
    test_pack_bf16();
    test_qk_bf16_reference();
    test_split_reference();
    test_medium_reference();
    test_round(NULL);
    test_medium_rows(NULL);
    test_ptx_medium(NULL);
    test_i8("scalar", &attnx_kernels_scalar);
    for (int s = 0; s < attnx_isa_count(); s++) {
        const char *isa = attnx_isa_name_at(s);
        const attnx_kernels *kt = attnx_isa_kernels(isa);
        if (!kt || kt == &attnx_kernels_scalar) {
            if (!kt) printf("  %-7s not available here\n", isa);
            continue;
        }
        tested++;
        test_qk(isa, kt, 0);
        test_qk(isa, kt, 1);
        test_pv(isa, kt, 0);
        test_pv(isa, kt, 1);
        for (int rows = 0; rows < 2; rows++) {
            test_softmax(isa, kt, 0, rows);
            test_softmax(isa, kt, 1, rows);
        }
        test_mask(isa, kt, 0);
        test_mask(isa, kt, 1);
        test_pack(isa, kt);
        test_store(isa, kt);
        test_softmax_bwd(isa, kt);
        test_softcap(isa, kt);
        test_score_steps(isa, kt);
        test_half(isa, kt, ATTNX_HALF_F16);
        test_half(isa, kt, ATTNX_HALF_BF16);
        test_i8(isa, kt);
        test_qk_bf16(isa);
        test_pv_bf16(isa, 0);
        test_pv_bf16(isa, 1);
        test_split(isa);
        test_fma_burn(isa, kt);
        test_dot_burns(isa);
        test_round(isa);
        test_medium_rows(isa);
        test_ptx_medium(isa);
    }
    if (!tested) printf("  no SIMD instruction set to compare here\n");
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
