/* Plain C test of the attnx core's forward pass, no Python: every
 * instruction set this build and CPU can run against a naive double-precision
 * attention, on random problems with masks, causal modes, lengths, GQA, odd
 * sizes, strided views and the variants (window, softcap, ALiBi, sinks),
 * and the backward against the naive gradients for the smaller ones; the
 * error codes; attnx_expf against exp; the forward without memory for the
 * parts of float32 on AMX tiles. The recompute of rows that come out inf or
 * NaN is off (a test hook): the inputs are finite, so no row needs it.
 *
 *   tests/c/run.sh [cc] [cases]     (builds the core from csrc/sources.txt)
 *
 * Ends with the line "N passed, M failed"; exits 1 on any failure. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "kernels/kernels.h"
#include "common.h"

static int64_t irand(int64_t n) { return (int64_t)(urand() * (double)n); }

/* The diagonal's shift d(i) - i of causal, the window and ALiBi. */
static int64_t offset_of(const attnx_problem *p)
{
    const int lr = p->causal == ATTNX_CAUSAL_LOWER_RIGHT ||
                   (p->causal == ATTNX_CAUSAL_NONE && p->align == ATTNX_ALIGN_LOWER_RIGHT);
    return lr ? p->Lk - p->Lq : 0;
}

/* Row i of head (b, h) in double, every step of attnx.h's list: the
 * probabilities pr[j] (the sink in the denominator) and, with a softcap,
 * t[j] = tanh(s/softcap). Returns 0 for a row that attends to nothing. */
static int naive_row(const attnx_problem *p, int64_t b, int64_t h, int64_t i, double *pr, double *t)
{
    const int64_t hk = h / (p->Hq / p->Hk), d0 = i + offset_of(p);
    const attnx_lengths *kls = &p->key_lengths, *qls = &p->query_lengths;
    const int64_t kl = kls->data ? kls->data[b * kls->sb + h * kls->sh] : p->Lk;
    const int64_t ql = qls->data ? qls->data[b * qls->sb + h * qls->sh] : p->Lq;
    if (i >= ql) return 0;
    const attnx_mask *m = &p->mask;
    double mx = -INFINITY;
    for (int64_t j = 0; j < p->Lk; j++) {
        int ok = j < kl;
        if (p->causal != ATTNX_CAUSAL_NONE) ok &= j <= d0;
        if (p->window.on && p->window.left >= 0) ok &= j >= d0 - p->window.left;
        if (p->window.on && p->window.right >= 0) ok &= j <= d0 + p->window.right;
        const int64_t mo = b * m->sb + h * m->sh + i * m->sq + j * m->sk;
        if (m->kind == ATTNX_MASK_BOOL) ok &= ((const unsigned char *)m->data)[mo] != 0;
        double x = 0.0;
        const float *q = p->q.data + b * p->q.sb + h * p->q.sh + i * p->q.sl;
        const float *k = p->k.data + b * p->k.sb + hk * p->k.sh + j * p->k.sl;
        for (int64_t d = 0; d < p->D; d++) x += (double)q[d] * k[d];
        x *= p->scale;
        t[j] = 0.0;
        if (p->softcap > 0.0f) {
            t[j] = tanh(x / p->softcap);
            x = p->softcap * t[j];
        }
        if (p->alibi.data)
            x -= p->alibi.data[b * p->alibi.sb + h * p->alibi.sh] * fabs((double)(d0 - j));
        if (m->kind == ATTNX_MASK_FLOAT) x += ((const float *)m->data)[mo];
        pr[j] = ok ? x : -INFINITY;
        if (pr[j] > mx) mx = pr[j];
    }
    if (mx == -INFINITY) return 0;
    double sum = 0.0;
    for (int64_t j = 0; j < p->Lk; j++) sum += (pr[j] = exp(pr[j] - mx));
    if (p->sinks.data) sum += exp(p->sinks.data[b * p->sinks.sb + h * p->sinks.sh] - mx);
    for (int64_t j = 0; j < p->Lk; j++) pr[j] /= sum;
    return 1;
}

/* Naive attention in double: out (B, Hq, Lq, Dv), contiguous. */
static void naive(const attnx_problem *p, double *out)
{
    double *pr = malloc(sizeof(double) * (size_t)(p->Lk + 1));
    double *t = malloc(sizeof(double) * (size_t)(p->Lk + 1));
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t h = 0; h < p->Hq; h++) {
            const int64_t hk = h / (p->Hq / p->Hk);
            for (int64_t i = 0; i < p->Lq; i++) {
                double *o = out + ((b * p->Hq + h) * p->Lq + i) * p->Dv;
                for (int64_t d = 0; d < p->Dv; d++) o[d] = 0.0;
                if (!naive_row(p, b, h, i, pr, t)) continue;
                for (int64_t j = 0; j < p->Lk; j++) {
                    if (pr[j] == 0.0) continue;
                    const float *v = p->v.data + b * p->v.sb + hk * p->v.sh + j * p->v.sl;
                    for (int64_t d = 0; d < p->Dv; d++) o[d] += pr[j] * v[d];
                }
            }
        }
    free(pr);
    free(t);
}

/* Its gradients for dout (B, Hq, Lq, Dv) contiguous: dq (B, Hq, Lq, D),
 * dk (B, Hk, Lk, D), dv (B, Hk, Lk, Dv), contiguous, zeroed here. */
static void naive_backward(const attnx_problem *p, const double *out, const float *dout, double *dq,
                           double *dk, double *dv)
{
    double *pr = malloc(sizeof(double) * (size_t)(p->Lk + 1));
    double *t = malloc(sizeof(double) * (size_t)(p->Lk + 1));
    memset(dq, 0, sizeof(double) * (size_t)(p->B * p->Hq * p->Lq * p->D));
    memset(dk, 0, sizeof(double) * (size_t)(p->B * p->Hk * p->Lk * p->D));
    memset(dv, 0, sizeof(double) * (size_t)(p->B * p->Hk * p->Lk * p->Dv));
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t h = 0; h < p->Hq; h++) {
            const int64_t hk = h / (p->Hq / p->Hk);
            for (int64_t i = 0; i < p->Lq; i++) {
                if (!naive_row(p, b, h, i, pr, t)) continue;
                const int64_t row = (b * p->Hq + h) * p->Lq + i;
                const float *g = dout + row * p->Dv,
                            *q = p->q.data + b * p->q.sb + h * p->q.sh + i * p->q.sl;
                double D = 0.0;
                for (int64_t e = 0; e < p->Dv; e++) D += g[e] * out[row * p->Dv + e];
                for (int64_t j = 0; j < p->Lk; j++) {
                    if (pr[j] == 0.0) continue;
                    const float *k = p->k.data + b * p->k.sb + hk * p->k.sh + j * p->k.sl;
                    const float *v = p->v.data + b * p->v.sb + hk * p->v.sh + j * p->v.sl;
                    const int64_t kr = (b * p->Hk + hk) * p->Lk + j;
                    double dp = 0.0;
                    for (int64_t e = 0; e < p->Dv; e++) {
                        dp += g[e] * (double)v[e];
                        dv[kr * p->Dv + e] += pr[j] * g[e];
                    }
                    double ds = pr[j] * (dp - D);
                    if (p->softcap > 0.0f) ds *= 1.0 - t[j] * t[j];
                    for (int64_t d = 0; d < p->D; d++) {
                        dq[row * p->D + d] += p->scale * ds * k[d];
                        dk[kr * p->D + d] += p->scale * ds * q[d];
                    }
                }
            }
        }
    free(pr);
    free(t);
}

/* max |got - want| / (tol + tol |want|) over n values (> 1: out of tolerance). */
static double worst_within(const float *got, const double *want, size_t n, double tol)
{
    double w = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double e = fabs(got[i] - want[i]) / (tol + tol * fabs(want[i]));
        if (!(e <= w)) w = e; /* NaN wins */
    }
    return w;
}

/* The gradients' tolerance: 1e-4 (float32 products). */
static double worst_of(const float *got, const double *want, size_t n)
{
    return worst_within(got, want, n, 1e-4);
}

/* "medium" where the kernels have bfloat16 dot products: Q, K, V (dO) and P
 * may be rounded to bfloat16 (2^-9 relative each), and the scores' errors
 * become the probabilities' relative errors: against the float64 reference
 * of the unrounded inputs, 3e-2 absolute and relative, for the outputs and
 * the gradients (what a wrong layout or a lost tile would exceed by far).
 * Elsewhere "medium" is "highest" (attnx.h), held to its tolerances. */
#define MEDIUM_TOL 3e-2
static int medium_dots(const attnx_problem *p)
{
    return p->precision == ATTNX_PRECISION_MEDIUM && attnx_active_kernels()->qk_bf16 != NULL;
}

static float *fill(size_t n)
{
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) x[i] = nrand();
    return x;
}

static int passed = 0, failed = 0;

/* K and V of p copied into pools of pages of `size` rows, (pages, size, Hk,
 * width), in a random page order with a spare page between: *table (B, per)
 * the pages of each batch index. Returns the problem reading the pools. */
typedef struct {
    float *k, *v;
    int32_t *table;
} paged_copy;

static attnx_problem paged_problem(const attnx_problem *p, int64_t size, paged_copy *c)
{
    const int64_t per = (p->Lk + size - 1) / size, n = p->B * per + 2;
    c->table = malloc(sizeof(int32_t) * (size_t)(p->B * per + 1));
    int32_t *order = malloc(sizeof(int32_t) * (size_t)n);
    for (int64_t x = 0; x < n; x++) order[x] = (int32_t)x;
    for (int64_t x = n - 1; x > 0; x--) { /* shuffle */
        const int64_t y = irand(x + 1);
        const int32_t tmp = order[x];
        order[x] = order[y], order[y] = tmp;
    }
    for (int64_t x = 0; x < p->B * per; x++) c->table[x] = order[x];
    free(order);
    attnx_problem pp = *p;
    pp.pages = (attnx_pages){.table = c->table, .sb = per, .size = size, .num_pages = n};
    const int64_t widths[2] = {p->D, p->Dv};
    for (int values = 0; values < 2; values++) {
        const int64_t w = widths[values];
        float *pool = fill((size_t)(n * size * p->Hk * w + 1));
        const attnx_tensor *src = values ? &p->v : &p->k;
        for (int64_t b = 0; b < p->B; b++)
            for (int64_t h = 0; h < p->Hk; h++)
                for (int64_t j = 0; j < p->Lk; j++)
                    memcpy(pool +
                               ((c->table[b * per + j / size] * size + j % size) * p->Hk + h) * w,
                           src->data + b * src->sb + h * src->sh + j * src->sl,
                           sizeof(float) * (size_t)w);
        const attnx_tensor t = {pool, size * p->Hk * w, w, p->Hk * w};
        if (values)
            c->v = pool, pp.v = t;
        else
            c->k = pool, pp.k = t;
    }
    return pp;
}

static void run_case(int t)
{
    attnx_problem p;
    memset(&p, 0, sizeof p);
    static const int64_t sizes[] = {1,  2,  3,  7,  8,  9,   15,  16, 17,
                                    31, 33, 63, 64, 65, 127, 129, 267};
    const int ns = sizeof sizes / sizeof *sizes;
    p.B = 1 + irand(2);
    p.Hk = 1 + irand(2);
    p.Hq = p.Hk * (1 + irand(3));
    p.Lq = sizes[irand(ns)];
    p.Lk = t % 5 == 0 ? 600 + irand(900) : sizes[irand(ns)]; /* long keys: split-K */
    if (t % 5 == 0) p.Lq = 1 + irand(3);
    /* every tenth: grouped-query decoding the core folds (a group's heads as rows) */
    const int fold = t % 10 == 0;
    if (fold) p.Hq = p.Hk * (2 + irand(3)), p.Lq = 1;
    p.D = sizes[irand(ns - 4)];
    p.Dv = sizes[irand(ns - 4)];
    const int64_t pad = irand(3); /* rows longer than needed: strided views */
    float *q = fill((size_t)(p.B * p.Hq * p.Lq * (p.D + pad)));
    float *k = fill((size_t)(p.B * p.Hk * p.Lk * (p.D + pad)));
    float *v = fill((size_t)(p.B * p.Hk * p.Lk * (p.Dv + pad)));
    p.q = (attnx_tensor){q, p.Hq * p.Lq * (p.D + pad), p.Lq * (p.D + pad), p.D + pad};
    p.k = (attnx_tensor){k, p.Hk * p.Lk * (p.D + pad), p.Lk * (p.D + pad), p.D + pad};
    p.v = (attnx_tensor){v, p.Hk * p.Lk * (p.Dv + pad), p.Lk * (p.Dv + pad), p.Dv + pad};
    const size_t nout = (size_t)(p.B * p.Hq * p.Lq * p.Dv);
    float *out = malloc(sizeof(float) * (nout ? nout : 1));
    p.out = (attnx_out_tensor){out, p.Hq * p.Lq * p.Dv, p.Lq * p.Dv, p.Dv};
    p.scale = 1.0f / sqrtf((float)p.D);
    p.causal = (int)irand(3);

    void *mask = NULL;
    p.mask.kind = (int)irand(3);
    if (p.mask.kind != ATTNX_MASK_NONE) { /* (Lq, Lk) broadcast over batch and heads, or per key */
        const int per_key = (int)irand(2);
        const size_t n = (size_t)(p.Lq * p.Lk);
        if (p.mask.kind == ATTNX_MASK_BOOL) {
            unsigned char *m = malloc(n);
            for (size_t i = 0; i < n; i++) m[i] = urand() > 0.3;
            mask = m;
        } else {
            float *m = malloc(sizeof(float) * n);
            for (size_t i = 0; i < n; i++) m[i] = urand() > 0.3 ? nrand() : -INFINITY;
            mask = m;
        }
        p.mask.data = mask;
        p.mask.sq = per_key ? 0 : p.Lk;
        p.mask.sk = 1;
    }
    int64_t *kl = NULL, *ql = NULL;
    if (irand(2)) { /* per batch, or per head: equal within each GQA group (which lets
                       decoding fold a group into the rows of one problem) or not */
        const int per_head = fold ? 2 : (int)irand(3);
        kl = malloc(sizeof(int64_t) * (size_t)(p.B * p.Hq));
        for (int64_t x = 0; x < p.B * p.Hq; x++) kl[x] = irand(p.Lk + 1);
        if (per_head == 2)
            for (int64_t x = 0; x < p.B * p.Hq; x++) kl[x] = kl[x - x % (p.Hq / p.Hk)];
        p.key_lengths = per_head ? (attnx_lengths){kl, p.Hq, 1} : (attnx_lengths){kl, 1, 0};
    }
    if (irand(3) == 0) {
        ql = malloc(sizeof(int64_t) * (size_t)p.B);
        for (int64_t b = 0; b < p.B; b++) ql[b] = irand(p.Lq + 1);
        p.query_lengths = (attnx_lengths){ql, 1, 0};
    }
    p.num_threads = 1 + (int)irand(3);
    /* the variants, each in about a quarter of the cases */
    float *slopes = NULL, *sinks = NULL;
    if (irand(3) == 0)
        p.window =
            (attnx_window){.on = 1, .left = irand(p.Lk + 2) - 1, .right = irand(p.Lk + 2) - 1};
    p.align = (int)irand(2);
    if (irand(4) == 0) p.softcap = 0.5f + 3.0f * (float)urand();
    /* MEDIUM: to the tolerance of bfloat16 products where the kernels have
     * them (medium_dots), else HIGHEST's */
    p.precision = (int)irand(2);
    if (irand(4) == 0) { /* powers of two: slope · distance exact in float, as in double */
        slopes = malloc(sizeof(float) * (size_t)(p.B * p.Hq));
        for (int64_t x = 0; x < p.B * p.Hq; x++) slopes[x] = ldexpf(1.0f, -3 - (int)irand(6));
        p.alibi = (attnx_head_values){slopes, p.Hq, 1};
    }
    if (irand(4) == 0) {
        sinks = fill((size_t)p.Hq);
        p.sinks = (attnx_head_values){sinks, 0, 1};
    }
    if (fold) { /* nothing that depends on the query's position or differs in a group */
        p.window.on = 0, p.alibi.data = NULL, p.sinks.data = NULL, p.query_lengths.data = NULL;
        if (p.causal == ATTNX_CAUSAL_UPPER_LEFT) p.causal = ATTNX_CAUSAL_LOWER_RIGHT;
    }
    float *lse = malloc(sizeof(float) * (size_t)(p.B * p.Hq * p.Lq + 1));
    p.lse = (attnx_out_tensor){lse, p.Hq * p.Lq, p.Lq, 1};

    double *ref = malloc(sizeof(double) * (nout ? nout : 1));
    naive(&p, ref);
    /* a third of the cases: the keys and values in pages too, 1 to 200 rows a page */
    paged_copy pc = {NULL, NULL, NULL};
    const int paged = irand(3) == 0;
    const attnx_problem pp = paged ? paged_problem(&p, 1 + irand(200), &pc) : p;
    /* the backward, for problems small enough to differentiate naively here */
    const int grad = p.B * p.Hq * p.Lq * p.Lk * (p.D + p.Dv) < 4000000;
    const size_t nq = (size_t)(p.B * p.Hq * p.Lq * p.D), nk = (size_t)(p.B * p.Hk * p.Lk * p.D),
                 nv = (size_t)(p.B * p.Hk * p.Lk * p.Dv);
    float *dout = fill(nout), *dq = malloc(4 * (nq + 1)), *dk = malloc(4 * (nk + 1)),
          *dv = malloc(4 * (nv + 1));
    double *rq = malloc(8 * (nq + 1)), *rk = malloc(8 * (nk + 1)), *rv = malloc(8 * (nv + 1));
    if (grad) naive_backward(&p, ref, dout, rq, rk, rv);
    for (int s = 0; s < attnx_isa_count(); s++) {
        const char *isa = attnx_isa_name_at(s);
        if (!attnx_isa_available(isa)) continue;
        attnx_set_isa(isa);
        double worst = 0.0;
        attnx_status st = ATTNX_OK;
        int bad = 0;
        for (int pass = 0; pass < 1 + paged && !bad; pass++) { /* the arrays, then the pages */
            for (size_t i = 0; i < nout; i++) out[i] = NAN;
            st = attnx_forward(pass ? &pp : &p);
            bad = st != ATTNX_OK;
            const double abs_tol = medium_dots(&p) ? MEDIUM_TOL : 1e-5;
            const double rel_tol = medium_dots(&p) ? MEDIUM_TOL : 5e-6;
            for (size_t i = 0; i < nout && !bad; i++) {
                const double err = fabs(out[i] - ref[i]);
                if (!(err <= abs_tol + rel_tol * fabs(ref[i]))) bad = 1;
                if (err > worst) worst = err;
            }
            if (bad && pass) printf("(paged, %lld rows a page) ", (long long)pp.pages.size);
        }
        if (paged && !bad) { /* the pages are forward-only: the backward refuses them */
            attnx_grad_problem gp;
            memset(&gp, 0, sizeof gp);
            gp.f = pp;
            const char *field = NULL;
            bad = attnx_check_grad_problem(&gp, &field) != ATTNX_ERR_ARG || !field ||
                  strcmp(field, "f.pages") != 0;
            for (size_t i = 0; i < nout; i++) out[i] = NAN; /* the backward below reads p's */
            st = attnx_forward(&p);
            bad |= st != ATTNX_OK;
        }
        double gworst = 0.0;
        if (grad && !bad) {
            attnx_grad_problem g;
            memset(&g, 0, sizeof g);
            g.f = p;
            g.o = (attnx_tensor){out, p.Hq * p.Lq * p.Dv, p.Lq * p.Dv, p.Dv};
            g.dout = (attnx_tensor){dout, p.Hq * p.Lq * p.Dv, p.Lq * p.Dv, p.Dv};
            g.lse = (attnx_tensor){lse, p.Hq * p.Lq, p.Lq, 1};
            g.dq = (attnx_out_tensor){dq, p.Hq * p.Lq * p.D, p.Lq * p.D, p.D};
            g.dk = (attnx_out_tensor){dk, p.Hk * p.Lk * p.D, p.Lk * p.D, p.D};
            g.dv = (attnx_out_tensor){dv, p.Hk * p.Lk * p.Dv, p.Lk * p.Dv, p.Dv};
            const attnx_status gs = attnx_backward(&g);
            const double gtol = medium_dots(&p) ? MEDIUM_TOL : 1e-4;
            gworst = gs != ATTNX_OK ? INFINITY : worst_within(dq, rq, nq, gtol);
            const double wk = worst_within(dk, rk, nk, gtol), wv = worst_within(dv, rv, nv, gtol);
            if (!(wk <= gworst)) gworst = wk;
            if (!(wv <= gworst)) gworst = wv;
            bad = !(gworst <= 1.0);
        }
        if (bad) {
            failed++;
            printf("FAIL case %d isa %s: B=%lld Hq=%lld Hk=%lld Lq=%lld Lk=%lld D=%lld Dv=%lld "
                   "mask=%d causal=%d kl=%d ql=%d threads=%d window=%d(%lld,%lld) align=%d "
                   "softcap=%g alibi=%d sinks=%d status=%s worst=%g grad=%g\n",
                   t, isa, (long long)p.B, (long long)p.Hq, (long long)p.Hk, (long long)p.Lq,
                   (long long)p.Lk, (long long)p.D, (long long)p.Dv, p.mask.kind, p.causal,
                   kl != NULL, ql != NULL, p.num_threads, p.window.on, (long long)p.window.left,
                   (long long)p.window.right, p.align, p.softcap, slopes != NULL, sinks != NULL,
                   attnx_strerror(st), worst, gworst);
        } else {
            passed++;
        }
    }
    free(pc.k), free(pc.v), free(pc.table);
    free(slopes), free(sinks), free(lse), free(dout), free(dq), free(dk), free(dv);
    free(rq), free(rk), free(rv);
    free(q);
    free(k);
    free(v);
    free(out);
    free(ref);
    free(mask);
    free(kl);
    free(ql);
}

/* attnx_forward refuses, and attnx_check_problem names the member at fault. */
static int refuses(const attnx_problem *p, attnx_status want, const char *field)
{
    const char *got = NULL;
    const attnx_status st = attnx_check_problem(p, &got);
    const int ok = attnx_forward(p) == want && st == want &&
                   (field ? got && strcmp(got, field) == 0 : got == NULL);
    if (!ok)
        printf("FAIL refusal: want %s (%s), got %s (%s)\n", attnx_strerror(want),
               field ? field : "no field", attnx_strerror(st), got ? got : "no field");
    return ok;
}

static void check_errors(void)
{
    attnx_problem p;
    memset(&p, 0, sizeof p);
    p.B = 1;
    p.Hq = 3;
    p.Hk = 2;
    p.Lq = 1;
    p.Lk = 1;
    p.D = 1;
    p.Dv = 1;
    p.scale = 1.0f;
    float x = 1.0f, out = 0.0f;
    p.q.data = p.k.data = p.v.data = &x;
    p.out.data = &out;
    int ok = refuses(&p, ATTNX_ERR_SHAPE, "Hk"); /* 3 heads over 2 */
    p.Hq = 2;
    ok &= refuses(&p, ATTNX_OK, NULL);
    p.scale = INFINITY;
    ok &= refuses(&p, ATTNX_ERR_ARG, "scale");
    p.scale = 1.0f;
    p.causal = 3;
    ok &= refuses(&p, ATTNX_ERR_ARG, "causal");
    p.causal = ATTNX_CAUSAL_NONE;
    p.precision = 2;
    ok &= refuses(&p, ATTNX_ERR_ARG, "precision");
    p.precision = -1;
    ok &= refuses(&p, ATTNX_ERR_ARG, "precision");
    p.precision = ATTNX_PRECISION_MEDIUM;
    ok &= refuses(&p, ATTNX_OK, NULL);
    p.precision = ATTNX_PRECISION_HIGHEST;
    p.mask.kind = -1;
    ok &= refuses(&p, ATTNX_ERR_ARG, "mask.kind");
    p.mask.kind = ATTNX_MASK_BOOL;
    ok &= refuses(&p, ATTNX_ERR_NULL, "mask.data");
    p.mask.kind = ATTNX_MASK_NONE;
    int64_t len = 2;
    p.key_lengths.data = &len;
    ok &= refuses(&p, ATTNX_ERR_LENGTH, "key_lengths"); /* past Lk */
    p.key_lengths.data = NULL;
    p.query_lengths.data = &len;
    ok &= refuses(&p, ATTNX_ERR_LENGTH, "query_lengths"); /* past Lq */
    p.query_lengths.data = NULL;
    p.Lq = -1;
    ok &= refuses(&p, ATTNX_ERR_SHAPE, "Lq");
    p.Lq = 1;
    p.q.data = NULL;
    ok &= refuses(&p, ATTNX_ERR_NULL, "q.data");
    p.q.data = &x;
    p.out.data = NULL;
    ok &= refuses(&p, ATTNX_ERR_NULL, "out.data");
    p.out.data = &out;
    p.B = p.Hq = p.Hk = p.Lq = p.Lk = INT64_MAX / 4;
    ok &= refuses(&p, ATTNX_ERR_OVERFLOW, "size");
    ok &= attnx_forward(NULL) == ATTNX_ERR_NULL;
    ok &= attnx_set_isa("no-such-isa") == ATTNX_ERR_ISA;
    if (ok)
        passed++;
    else {
        failed++;
        printf("FAIL error codes\n");
    }
}

/* attnx_expf against the correctly rounded exp (double, rounded to float) on
 * every 64th float of [-87.33, 0] (the range the kernels use): within 1 ulp. */
static int64_t float_order(float x)
{
    int32_t i;
    memcpy(&i, &x, sizeof i);
    return i < 0 ? (int64_t)INT32_MIN - i : i;
}

/* The fingerprints: every single-bit change of a buffer changes them, and the
 * pooled one does not depend on the thread count. */
static void check_fingerprint(void)
{
    enum { N = (64 << 20) + 1 }; /* enough for the pool (FP_POOLED), and a partial chunk */
    unsigned char *buf = malloc(N);
    for (size_t i = 0; i < N; i++) buf[i] = (unsigned char)(i * 2654435761u >> 13);
    const uint64_t h = attnx_fingerprint(0, buf, 1000), hp = attnx_fingerprint_parallel(buf, N);
    int ok = 1;
    for (int bit = 0; bit < 8 * 1000; bit += 7) {
        buf[bit / 8] ^= (unsigned char)(1u << (bit % 8));
        ok &= attnx_fingerprint(0, buf, 1000) != h;
        buf[bit / 8] ^= (unsigned char)(1u << (bit % 8));
    }
    for (size_t at = 0; at < N; at += N / 5) {
        buf[at] ^= 1;
        ok &= attnx_fingerprint_parallel(buf, N) != hp;
        buf[at] ^= 1;
    }
    for (int nt = 1; nt <= 3; nt++) {
        attnx_set_num_threads(nt);
        ok &= attnx_fingerprint_parallel(buf, N) == hp;
    }
    attnx_set_num_threads(0);
    ok &= attnx_fingerprint(0, buf, 1000) == h && attnx_fingerprint(1, buf, 1000) != h;
    if (ok) {
        passed++;
    } else {
        failed++;
        printf("FAIL fingerprint: a change went unseen, or the thread count changed it\n");
    }
    free(buf);
}

static void check_exp(void)
{
    int64_t worst = 0;
    float at = 0.0f;
    const float start = -87.33f;
    uint32_t bits; /* negative floats: magnitude falls with the pattern */
    memcpy(&bits, &start, sizeof bits);
    for (; bits > 0x80000000u; bits = bits > 0x80000000u + 64 ? bits - 64 : 0x80000000u) {
        float x;
        memcpy(&x, &bits, sizeof x);
        const int64_t d = float_order(attnx_expf(x)) - float_order((float)exp((double)x));
        if ((d < 0 ? -d : d) > worst) {
            worst = d < 0 ? -d : d;
            at = x;
        }
    }
    const int ok = worst <= 1 && attnx_expf(-INFINITY) == 0.0f && attnx_expf(0.0f) == 1.0f &&
                   isnan(attnx_expf(NAN)) && attnx_expf(-100.0f) == 0.0f;
    if (ok)
        passed++;
    else {
        failed++;
        printf("FAIL exp: %lld ulp at %g\n", (long long)worst, at);
    }
}

/* Without memory for the parts of float32 on AMX tiles (a prefill-sized
 * problem that takes them where the CPU has AMX), the forward takes the
 * FMAs: the same result within the tolerances, no failure, no crash. */
extern int attnx_test_no_parts;
/* output.c: the recompute of inf and NaN rows off (every input here is
 * finite, so no row needs it, and a NaN from memory read wrongly shows) */
extern int attnx_test_no_repair;

static void check_no_parts(void)
{
    attnx_problem p;
    memset(&p, 0, sizeof p);
    p.B = 1, p.Hq = p.Hk = 2, p.Lq = 800, p.Lk = 200, p.D = p.Dv = 64;
    const size_t nq = (size_t)(p.Hq * p.Lq * p.D), nk = (size_t)(p.Hk * p.Lk * p.D);
    float *q = fill(nq), *k = fill(nk), *v = fill(nk), *out = malloc(sizeof(float) * nq);
    double *ref = malloc(sizeof(double) * nq);
    p.q = (attnx_tensor){q, p.Hq * p.Lq * p.D, p.Lq * p.D, p.D};
    p.k = (attnx_tensor){k, p.Hk * p.Lk * p.D, p.Lk * p.D, p.D};
    p.v = (attnx_tensor){v, p.Hk * p.Lk * p.D, p.Lk * p.D, p.D};
    p.out = (attnx_out_tensor){out, p.Hq * p.Lq * p.D, p.Lq * p.D, p.D};
    p.scale = 0.125f;
    p.num_threads = 2;
    naive(&p, ref);
    for (int denied = 0; denied < 2; denied++) {
        attnx_test_no_parts = denied;
        const attnx_status st = attnx_forward(&p);
        const double worst = st == ATTNX_OK ? worst_of(out, ref, nq) : INFINITY;
        if (worst <= 1.0) {
            passed++;
        } else {
            failed++;
            printf("FAIL no parts (denied %d): status %s worst %g\n", denied, attnx_strerror(st),
                   worst);
        }
    }
    attnx_test_no_parts = 0;
    free(q), free(k), free(v), free(out), free(ref);
}

int main(int argc, char **argv)
{
    const int n = argc > 1 ? atoi(argv[1]) : 300;
    printf("attnx core test: default ISA %s, %d random cases\n", attnx_isa_name(), n);
    check_errors();
    check_exp();
    check_fingerprint();
    attnx_test_no_repair = 1;
    check_no_parts();
    for (int t = 0; t < n; t++) run_case(t);
    printf("%d passed, %d failed\n", passed, failed);
    return failed != 0;
}
