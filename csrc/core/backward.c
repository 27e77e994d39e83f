/* The backward pass: FlashAttention-2's scheme on CPU tiles. With the
 * forward's output O and the log of each row's softmax sum (lse), for an
 * upstream gradient dO, tile by tile (the Lq×Lk matrix is never built):
 *
 *   P  = exp(S − lse)        S = scale·Q Kᵀ + masks, recomputed as the forward does
 *                            (lse includes the sink, which needs nothing more here)
 *   dV += Pᵀ dO              dP = dO Vᵀ          D = rowsum(dO ∘ O)
 *   dS = P ∘ (dP − D)        (exactly 0 where P is 0)
 *   dQ += scale · dS K       dK += scale · dSᵀ Q        d(mask) = dS
 *   (with a softcap, dS is multiplied by 1 − (S_capped / softcap)² before dQ, dK)
 *
 * Items are (batch, key/value head, range of keys). An item owns the dK and
 * dV rows of its keys (the query heads of a GQA group are added in a fixed
 * order) and the dQ rows of its heads; with several key ranges a head (few
 * heads, many threads), each range writes its own dQ partial and the
 * partials are summed afterwards in range order. No atomics: the same bits
 * on every run with a given thread count. */
#include <stdlib.h>
#include <string.h>

#include "core/core.h"

typedef struct {
    attnx_run run;
    const attnx_grad_problem *g;
    bwd_plan plan;
    float *partial; /* nsplit > 1: dQ per range, (nsplit, B, Hq, Lq, D) */
    bwd_scratch *scr;
} bwd_job;

/* The rows of a (B, H, L, E) gradient array at (b, h, i). */
static float *at(const attnx_out_tensor *t, int64_t b, int64_t h, int64_t i)
{
    return t->data + b * t->sb + h * t->sh + i * t->sl;
}

static const float *at_in(const attnx_tensor *t, int64_t b, int64_t h, int64_t i)
{
    return t->data + b * t->sb + h * t->sh + i * t->sl;
}

/* One tile: keys j0 .. j0+nk-1 against the packed block of queries
 * i0 .. i0+nq-1 of head (b, h). */
static void bwd_tile(const bwd_job *bj, const bwd_scratch *s, int64_t b, int64_t h, int64_t i0,
                     int nq, int64_t j0, int nk)
{
    const attnx_problem *p = bj->run.p;
    const attnx_grad_problem *g = bj->g;
    const attnx_kernels *kt = bj->run.kt;
    const int64_t hk = h / bj->plan.group;
    const float *k = at_in(&p->k, b, hk, j0), *v = at_in(&p->v, b, hk, j0);
    const float *q = at_in(&p->q, b, h, i0), *dout = at_in(&g->dout, b, h, i0);

    attnx_score_tile(&bj->run, s->qt, 0, k, p->k.sl, b, h, i0, nq, j0, nk, s->st, /* S */
                     s->capped);
    kt->softmax_final(s->st, BQ, nq, nk, s->lse, s->ones);                     /* P */
    kt->qk(s->dot, BQ, nq, v, p->v.sl, nk, p->Dv, s->dpt);                     /* dP */
    kt->ptx(s->st, BQ, nq, dout, g->dout.sl, nk, p->Dv, at(&g->dv, b, hk, j0), /* dV += Pᵀ dO */
            g->dv.sl);
    kt->softmax_bwd(s->st, s->dpt, BQ, nq, nk, s->dvec); /* dS */
    if (g->dmask) {
        float *dm = g->dmask + ((b * p->Hq + h) * p->Lq + i0) * p->Lk + j0;
        for (int i = 0; i < nq; i++)
            for (int j = 0; j < nk; j++) dm[i * p->Lk + j] = s->dpt[j * BQ + i];
    }
    if (p->softcap > 0.0f) /* dS through the tanh: × (1 - (capped / softcap)²) */
        kt->softcap_bwd(s->dpt, s->capped, BQ, nq, nk, 1.0f / p->softcap);
    kt->ptx(s->dpt, BQ, nq, q, p->q.sl, nk, p->D, at(&g->dk, b, hk, j0), /* dK += dSᵀ Q */
            g->dk.sl);
    kt->pv(s->dpt, BQ, nq, k, p->k.sl, nk, p->D, NULL, s->dqacc, bj->plan.ldqa); /* dQ += dS K */
}

/* A block's queries packed, its upstream gradient packed, its lse and
 * D = rowsum(dO ∘ O); the dQ accumulator zeroed. */
static void bwd_start_block(const bwd_job *bj, const bwd_scratch *s, int64_t b, int64_t h,
                            int64_t i0, int nq)
{
    const attnx_problem *p = bj->run.p;
    const attnx_grad_problem *g = bj->g;
    const float *dout = at_in(&g->dout, b, h, i0), *o = at_in(&g->o, b, h, i0);
    attnx_pack_rows_t(bj->run.kt, at_in(&p->q, b, h, i0), p->q.sl, nq, p->D, bj->run.pre_scale,
                      s->qt);
    attnx_pack_rows_t(bj->run.kt, dout, g->dout.sl, nq, p->Dv, 1.0f, s->dot);
    for (int i = 0; i < BQ; i++) {
        float d = 0.0f;
        if (i < nq)
            for (int64_t e = 0; e < p->Dv; e++) d += dout[i * g->dout.sl + e] * o[i * g->o.sl + e];
        s->dvec[i] = d;
        s->lse[i] =
            i < nq ? g->lse.data[b * g->lse.sb + h * g->lse.sh + (i0 + i) * g->lse.sl] : INFINITY;
    }
    memset(s->dqacc, 0, sizeof(float) * (size_t)nq * (size_t)bj->plan.ldqa);
}

/* Queries i0 .. i0+rows-1 of head (b, h) against keys [kbeg, kstop): their
 * contribution to dK and dV, and their dQ rows (scaled) written to dq. */
static void bwd_block(const bwd_job *bj, const bwd_scratch *s, int64_t b, int64_t h, int64_t i0,
                      int64_t kbeg, int64_t kstop, float *dq, int64_t dq_sl)
{
    const attnx_problem *p = bj->run.p;
    const head_bounds hb = bounds_of(p, b, h);
    const int rows = (int)min64(BQ, p->Lq - i0);
    const int nq = rows_attending(&hb, i0, rows);
    const int64_t kend = min64(kstop, keys_end(&hb, i0, nq));
    const int64_t kfrom = max64(kbeg, keys_begin(&hb, i0));
    for (int i = 0; i < rows; i++) memset(dq + i * dq_sl, 0, sizeof(float) * (size_t)p->D);
    if (nq == 0 || kfrom >= kend) return;
    bwd_start_block(bj, s, b, h, i0, nq);
    for (int64_t j0 = kfrom; j0 < kend; j0 += BK)
        bwd_tile(bj, s, b, h, i0, nq, j0, (int)min64(BK, kend - j0));
    for (int i = 0; i < nq; i++)
        for (int64_t e = 0; e < p->D; e++)
            dq[i * dq_sl + e] = p->scale * s->dqacc[i * bj->plan.ldqa + e];
}

/* Item i: the keys [kbeg, kstop) of key/value head (b, hk), against every
 * query of its group. */
static void bwd_item(void *arg, int tid, int64_t item)
{
    const bwd_job *bj = arg;
    const bwd_scratch *s = &bj->scr[tid];
    const attnx_problem *p = bj->run.p;
    const attnx_grad_problem *g = bj->g;
    const int64_t split = item % bj->plan.nsplit, bhk = item / bj->plan.nsplit;
    const int64_t hk = bhk % p->Hk, b = bhk / p->Hk, group = bj->plan.group;
    const int64_t kbeg = split * bj->plan.kchunk, kstop = min64(p->Lk, kbeg + bj->plan.kchunk);
    for (int64_t j = kbeg; j < kstop; j++) {
        memset(at(&g->dk, b, hk, j), 0, sizeof(float) * (size_t)p->D);
        memset(at(&g->dv, b, hk, j), 0, sizeof(float) * (size_t)p->Dv);
    }
    for (int64_t h = hk * group; h < (hk + 1) * group; h++)
        for (int64_t i0 = 0; i0 < p->Lq; i0 += BQ) {
            if (bj->plan.nsplit == 1)
                bwd_block(bj, s, b, h, i0, kbeg, kstop, at(&g->dq, b, h, i0), g->dq.sl);
            else
                bwd_block(bj, s, b, h, i0, kbeg, kstop,
                          bj->partial + (((split * p->B + b) * p->Hq + h) * p->Lq + i0) * p->D,
                          p->D);
        }
    for (int64_t j = kbeg; j < kstop; j++)
        for (int64_t e = 0; e < p->D; e++) at(&g->dk, b, hk, j)[e] *= p->scale;
}

/* dQ from the per-range partials, summed in range order. */
static void bwd_merge_dq(const bwd_job *bj)
{
    const attnx_problem *p = bj->run.p;
    const int64_t per = p->B * p->Hq * p->Lq * p->D;
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t h = 0; h < p->Hq; h++)
            for (int64_t i = 0; i < p->Lq; i++) {
                float *dq = at(&bj->g->dq, b, h, i);
                const float *src = bj->partial + ((b * p->Hq + h) * p->Lq + i) * p->D;
                for (int64_t e = 0; e < p->D; e++) dq[e] = src[e];
                for (int64_t sp = 1; sp < bj->plan.nsplit; sp++)
                    for (int64_t e = 0; e < p->D; e++) dq[e] += src[sp * per + e];
            }
}

static void free_scratch(bwd_job *bj, int taken)
{
    for (int t = 0; t < taken; t++) attnx_scratch_give_back(t, bj->scr[t].qt);
    free(bj->scr);
    free(bj->partial);
}

static attnx_status alloc_scratch(bwd_job *bj)
{
    const int nt = bj->plan.threads;
    if (bj->plan.partial && !(bj->partial = attnx_alloc_floats(bj->plan.partial)))
        return ATTNX_ERR_NOMEM;
    if (!(bj->scr = calloc((size_t)nt, sizeof(bwd_scratch)))) {
        free_scratch(bj, 0);
        return ATTNX_ERR_NOMEM;
    }
    for (int t = 0; t < nt; t++) {
        float *base = attnx_scratch_take(t, bj->plan.scratch);
        if (!base) {
            free_scratch(bj, t);
            return ATTNX_ERR_NOMEM;
        }
        bj->scr[t] = attnx_bwd_scratch_at(base, bj->run.p, bj->plan.ldqa);
    }
    return ATTNX_OK;
}

attnx_status attnx_backward(const attnx_grad_problem *g)
{
    attnx_status st = attnx_check_grad_problem(g, NULL);
    if (st != ATTNX_OK || g->f.B == 0 || g->f.Hk == 0) return st;
    bwd_job bj = {.run = attnx_run_of(&g->f), .g = g};
    if ((st = attnx_plan_backward(&g->f, &bj.plan)) != ATTNX_OK) return st;
    if ((st = alloc_scratch(&bj)) != ATTNX_OK) return st;
    attnx_parallel_items(bj.plan.threads, bj.plan.n_items, bwd_item, &bj);
    if (bj.plan.nsplit > 1) bwd_merge_dq(&bj);
    free_scratch(&bj, bj.plan.threads);
    return ATTNX_OK;
}
