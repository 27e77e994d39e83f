/* The driver: FlashAttention-style forward over tiles, calling the kernels of
 * the active instruction set through their table (kernels.h).
 *
 * Work is split into items, one per (batch, head, block of BQ queries). For
 * each item the queries are packed once (scaled, transposed), then the keys
 * are visited in tiles of BK: scores, masks, online softmax (running max and
 * sum, rescale), and the weighted sum of values, all in a few KiB of scratch;
 * the output is normalised once at the end. The Lq×Lk matrix is never built
 * unless the caller asked for the weights, which are then produced by a
 * second pass over the keys with the final max and sum (exact, not rescaled).
 *
 * Causal masks and key lengths shorten the range of keys visited (whole tiles
 * are skipped); only tiles on the diagonal are masked element by element.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "kernels.h"
#include "threads.h"

#define BQ ATTNX_BQ
#define BK ATTNX_BK

typedef struct {
    float *qt;     /* (D, BQ) */
    float *st;     /* (BK, BQ) */
    float *acc;    /* (BQ, ldacc) */
    float *m, *l, *alpha; /* (BQ) each */
} scratch;

typedef struct {
    const attnx_problem *p;
    const attnx_kernels *kt;
    int64_t nqb;       /* query blocks per head */
    int64_t n_items;   /* B * Hq * nqb */
    int64_t ldacc;
    scratch *scr;      /* one per thread */
    atomic_llong next; /* next item to take */
} job;

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Causal, bool and float masks on one tile of scores.
 * st: (nk, BQ) for queries i0.. i0+nq-1 and keys j0 .. j0+nk-1 of head (b, h). */
static void apply_masks(const attnx_problem *p, int64_t b, int64_t h, int64_t i0, int nq,
                        int64_t j0, int nk, int64_t offset, float *st)
{
    if (p->causal != ATTNX_CAUSAL_NONE && j0 + nk - 1 > i0 + offset) {
        for (int j = 0; j < nk; j++)
            for (int i = 0; i < nq; i++)
                if (j0 + j > i0 + i + offset) st[j * BQ + i] = -INFINITY;
    }
    if (p->mask_kind == ATTNX_MASK_BOOL) {
        const unsigned char *mb = (const unsigned char *)p->mask + b * p->mask_sb + h * p->mask_sh
                                  + i0 * p->mask_sq + j0 * p->mask_sk;
        for (int j = 0; j < nk; j++)
            for (int i = 0; i < nq; i++)
                if (!mb[i * p->mask_sq + j * p->mask_sk]) st[j * BQ + i] = -INFINITY;
    } else if (p->mask_kind == ATTNX_MASK_FLOAT) {
        const float *mf = (const float *)p->mask + b * p->mask_sb + h * p->mask_sh
                          + i0 * p->mask_sq + j0 * p->mask_sk;
        for (int j = 0; j < nk; j++)
            for (int i = 0; i < nq; i++) st[j * BQ + i] += mf[i * p->mask_sq + j * p->mask_sk];
    }
}

/* Scores of one tile, masked: st (nk, BQ) = scale * Q[i0..] · K[j0..]ᵀ (+ masks). */
static void tile_scores(const job *jb, const scratch *s, int64_t b, int64_t h, const float *k,
                        int64_t i0, int nq, int64_t j0, int nk, int64_t offset)
{
    const attnx_problem *p = jb->p;
    jb->kt->qk(s->qt, BQ, nq, k + j0 * p->k.sl, p->k.sl, nk, p->D, s->st);
    apply_masks(p, b, h, i0, nq, j0, nk, offset, s->st);
}

// one item: queries i0 .. i0+BQ-1 of head (b, h)
static void run_item(job *jb, scratch *s, int64_t item)
{
    const attnx_problem *p = jb->p;
    const attnx_kernels *kt = jb->kt;
    const int64_t qb = item % jb->nqb, bh = item / jb->nqb;
    const int64_t h = bh % p->Hq, b = bh / p->Hq;
    const int64_t hk = h / (p->Hq / p->Hk);
    const int64_t i0 = qb * BQ;
    const int rows = (int)min64(BQ, p->Lq - i0);

    const int64_t qlen = p->query_lengths ? p->query_lengths[b * p->ql_sb + h * p->ql_sh] : p->Lq;
    const int64_t klen = p->key_lengths ? p->key_lengths[b * p->kl_sb + h * p->kl_sh] : p->Lk;
    const int nq = (int)max64(0, min64(rows, qlen - i0));   /* rows that attend */
    const int64_t offset = p->causal == ATTNX_CAUSAL_LOWER_RIGHT ? p->Lk - p->Lq : 0;
    int64_t kend = klen;                                      /* keys visited: [0, kend) */
    if (p->causal != ATTNX_CAUSAL_NONE) kend = min64(kend, max64(0, i0 + nq + offset));

    float *out = p->out + b * p->out_sb + h * p->out_sh + i0 * p->out_sl;
    float *w = p->weights ? p->weights + ((b * p->Hq + h) * p->Lq + i0) * p->Lk : NULL;
    if (w) memset(w, 0, sizeof(float) * (size_t)rows * (size_t)p->Lk);
    for (int i = nq; i < rows; i++) memset(out + i * p->out_sl, 0, sizeof(float) * (size_t)p->Dv);
    if (nq == 0) return;

    // qt: (D, BQ) = scale * q[i0 .. i0+nq-1]ᵀ, padding columns zero
    const float *q = p->q.data + b * p->q.sb + h * p->q.sh + i0 * p->q.sl;
    for (int64_t d = 0; d < p->D; d++) {
        float *qd = s->qt + d * BQ;
        for (int i = 0; i < nq; i++) qd[i] = p->scale * q[i * p->q.sl + d];
        for (int i = nq; i < BQ; i++) qd[i] = 0.0f;
    }
    for (int i = 0; i < BQ; i++) { s->m[i] = -INFINITY; s->l[i] = 0.0f; }
    memset(s->acc, 0, sizeof(float) * (size_t)nq * (size_t)jb->ldacc);

    const float *k = p->k.data + b * p->k.sb + hk * p->k.sh;
    const float *v = p->v.data + b * p->v.sb + hk * p->v.sh;
    if (!w) {
        for (int64_t j0 = 0; j0 < kend; j0 += BK) {
            const int nk = (int)min64(BK, kend - j0);
            tile_scores(jb, s, b, h, k, i0, nq, j0, nk, offset);
            kt->softmax_online(s->st, BQ, nq, nk, s->m, s->l, s->alpha);
            kt->pv(s->st, BQ, nq, v + j0 * p->v.sl, p->v.sl, nk, p->Dv, s->alpha, s->acc, jb->ldacc);
        }
        for (int i = 0; i < nq; i++) {      /* normalise once; nothing allowed: zeros */
            const float inv = s->l[i] == 0.0f ? 0.0f : 1.0f / s->l[i];
            for (int64_t d = 0; d < p->Dv; d++) out[i * p->out_sl + d] = s->acc[i * jb->ldacc + d] * inv;
        }
        return;
    }

    /* need_weights: pass 1 finds each row's max and sum, pass 2 writes the
     * exact probabilities and accumulates the output from them. */
    for (int64_t j0 = 0; j0 < kend; j0 += BK) {
        const int nk = (int)min64(BK, kend - j0);
        tile_scores(jb, s, b, h, k, i0, nq, j0, nk, offset);
        kt->softmax_online(s->st, BQ, nq, nk, s->m, s->l, s->alpha);
    }
    float *inv_l = s->alpha;
    for (int i = 0; i < BQ; i++) inv_l[i] = (i < nq && s->l[i] != 0.0f) ? 1.0f / s->l[i] : 0.0f;
    for (int i = 0; i < nq; i++)
        if (s->l[i] != s->l[i]) inv_l[i] = s->l[i];           /* NaN propagates */
    for (int64_t j0 = 0; j0 < kend; j0 += BK) {
        const int nk = (int)min64(BK, kend - j0);
        tile_scores(jb, s, b, h, k, i0, nq, j0, nk, offset);
        kt->softmax_final(s->st, BQ, nq, nk, s->m, inv_l);
        for (int j = 0; j < nk; j++)
            for (int i = 0; i < nq; i++) w[i * p->Lk + j0 + j] = s->st[j * BQ + i];
        kt->pv(s->st, BQ, nq, v + j0 * p->v.sl, p->v.sl, nk, p->Dv, NULL, s->acc, jb->ldacc);
    }
    for (int i = 0; i < nq; i++) {
        const int none = s->l[i] == 0.0f;
        for (int64_t d = 0; d < p->Dv; d++)
            out[i * p->out_sl + d] = none ? 0.0f : s->acc[i * jb->ldacc + d];
    }
}

static void worker(void *arg, int tid)
{
    job *jb = arg;
    scratch *s = &jb->scr[tid];
    for (;;) {
        const int64_t item = atomic_fetch_add(&jb->next, 1);
        if (item >= jb->n_items) break;
        run_item(jb, s, item);
    }
}

/* ---- validation and set-up ------------------------------------------------ */

static int mul_ok(size_t a, size_t b, size_t *r)
{
    if (a != 0 && b > SIZE_MAX / a) return 0;
    *r = a * b;
    return 1;
}

static attnx_status check_lengths(const int64_t *len, int64_t sb, int64_t sh, int64_t B,
                                  int64_t H, int64_t limit)
{
    if (!len) return ATTNX_OK;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t x = len[b * sb + h * sh];
            if (x < 0 || x > limit) return ATTNX_ERR_LENGTH;
        }
    return ATTNX_OK;
}

static attnx_status validate(const attnx_problem *p)
{
    if (!p) return ATTNX_ERR_NULL;
    if (p->B < 0 || p->Hq < 0 || p->Hk < 0 || p->Lq < 0 || p->Lk < 0 || p->D < 0 || p->Dv < 0)
        return ATTNX_ERR_SHAPE;
    if (p->Hq > 0 && (p->Hk == 0 || p->Hq % p->Hk != 0)) return ATTNX_ERR_SHAPE;
    if (p->mask_kind < ATTNX_MASK_NONE || p->mask_kind > ATTNX_MASK_FLOAT) return ATTNX_ERR_ARG;
    if (p->causal < ATTNX_CAUSAL_NONE || p->causal > ATTNX_CAUSAL_LOWER_RIGHT) return ATTNX_ERR_ARG;
    if (!isfinite(p->scale)) return ATTNX_ERR_ARG;
    const int empty_out = p->B == 0 || p->Hq == 0 || p->Lq == 0;
    if (!empty_out) {
        if (!p->out && p->Dv > 0) return ATTNX_ERR_NULL;
        if (!p->q.data && p->D > 0) return ATTNX_ERR_NULL;
        if (p->Lk > 0 && ((!p->k.data && p->D > 0) || (!p->v.data && p->Dv > 0))) return ATTNX_ERR_NULL;
        if (p->mask_kind != ATTNX_MASK_NONE && !p->mask && p->Lk > 0) return ATTNX_ERR_NULL;
    }
    attnx_status st = check_lengths(p->key_lengths, p->kl_sb, p->kl_sh, p->B, p->Hq, p->Lk);
    if (st == ATTNX_OK) st = check_lengths(p->query_lengths, p->ql_sb, p->ql_sh, p->B, p->Hq, p->Lq);
    if (st != ATTNX_OK) return st;
    size_t n;   /* every element count the core indexes must fit in size_t bytes */
    if (!mul_ok((size_t)p->B, (size_t)p->Hq, &n) || !mul_ok(n, (size_t)p->Lq, &n) ||
        !mul_ok(n, (size_t)(p->Lk > p->Dv ? p->Lk : p->Dv), &n) || !mul_ok(n, sizeof(float), &n))
        return ATTNX_ERR_OVERFLOW;
    return ATTNX_OK;
}

static void free_scratch(scratch *scr, int n)
{
    for (int t = 0; t < n; t++) free(scr[t].qt);
    free(scr);
}

static void *alloc_floats(size_t n)
{
    size_t bytes;
    if (!mul_ok(n, sizeof(float), &bytes) || bytes > SIZE_MAX - 64) return NULL;
    bytes = (bytes + 63) & ~(size_t)63;   /* aligned_alloc wants a multiple of 64 */
    return aligned_alloc(64, bytes ? bytes : 64);
}

attnx_status attnx_forward(const attnx_problem *p)
{
    attnx_status st = validate(p);
    if (st != ATTNX_OK) return st;
    if (p->B == 0 || p->Hq == 0 || p->Lq == 0 || (p->Dv == 0 && !p->weights)) return ATTNX_OK;

    job jb;
    jb.p = p;
    jb.kt = attnx_active_kernels();
    jb.nqb = (p->Lq + BQ - 1) / BQ;
    jb.n_items = p->B * p->Hq * jb.nqb;
    jb.ldacc = (p->Dv + 15) & ~(int64_t)15;
    atomic_init(&jb.next, 0);

    /* threads: as asked, but no more than items, and one for small problems */
    int nt = p->num_threads > 0 ? p->num_threads : attnx_get_num_threads();
    const double flops = 4.0 * (double)p->B * (double)p->Hq * (double)p->Lq * (double)p->Lk
                         * (double)(p->D > 0 ? p->D : 1);
    if (flops < 2e6) nt = 1;
    if (nt > jb.n_items) nt = (int)jb.n_items;
    if (nt < 1) nt = 1;

    /* per thread: qt (D, BQ) | st (BK, BQ) | acc (BQ, ldacc) | m, l, alpha (BQ) */
    size_t per;
    if (!mul_ok((size_t)p->D + BK + (size_t)jb.ldacc + 3, BQ, &per)) return ATTNX_ERR_OVERFLOW;
    jb.scr = calloc((size_t)nt, sizeof(scratch));
    if (!jb.scr) return ATTNX_ERR_NOMEM;
    for (int t = 0; t < nt; t++) {
        float *base = alloc_floats(per);
        if (!base) { free_scratch(jb.scr, t); return ATTNX_ERR_NOMEM; }
        memset(base, 0, per * sizeof(float));
        scratch *s = &jb.scr[t];
        s->qt = base;
        s->st = s->qt + (size_t)p->D * BQ;
        s->acc = s->st + (size_t)BK * BQ;
        s->m = s->acc + (size_t)jb.ldacc * BQ;
        s->l = s->m + BQ;
        s->alpha = s->l + BQ;
    }
    attnx_parallel(nt, worker, &jb);
    free_scratch(jb.scr, nt);
    return ATTNX_OK;
}

const char *attnx_strerror(attnx_status status)
{
    switch (status) {
    case ATTNX_OK: return "success";
    case ATTNX_ERR_NULL: return "a required array pointer is NULL";
    case ATTNX_ERR_SHAPE: return "invalid shape: a negative size, or query heads not a multiple of key/value heads";
    case ATTNX_ERR_ARG: return "invalid argument: mask kind or causal mode out of range, or scale not finite";
    case ATTNX_ERR_LENGTH: return "a key or query length lies outside [0, L]";
    case ATTNX_ERR_OVERFLOW: return "the problem is too large: its byte count overflows size_t";
    case ATTNX_ERR_NOMEM: return "out of memory for scratch buffers";
    case ATTNX_ERR_ISA: return "that instruction set is not available on this CPU or build";
    }
    return "unknown error";
}
