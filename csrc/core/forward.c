/* The forward driver: FlashAttention-style attention over tiles, calling the
 * kernels of the active instruction set through their table (kernels.h).
 *
 *   check (validate.c) → plan (plan.c) → scratch (scratch.c)
 *   → the items over the thread pool (items.c, tile.c, output.c)
 *   → split-K partials merged (output.c)
 *
 * With too few query blocks to occupy every thread (decoding), the keys are
 * split across threads too and the partial softmaxes merged (split-K). */
#include <math.h>
#include <stdlib.h>

#include "core/core.h"

/* Item i: the block i / nsplit (queries i0 .. i0+BQ-1 of head (b, h)),
 * against key range i % nsplit. */
static void run_item(void *arg, int tid, int64_t item)
{
    const fwd_job *jb = arg;
    const fwd_scratch *s = &jb->scr[tid];
    const int64_t split = item % jb->plan.nsplit;
    const item_view it = attnx_view_item(jb, item / jb->plan.nsplit);
    if (split == 0) attnx_clear_unvisited(jb, &it);
    if (jb->plan.nsplit == 1) {
        if (it.nq == 0) return;
        if (it.w)
            attnx_weights_item(jb, s, &it);
        else
            attnx_online_item(jb, s, &it, it.kbeg, it.kend, NULL);
        return;
    }
    /* split-K: this item's range of keys, and where its partial result goes */
    const int64_t kbeg = max64(it.kbeg, split * jb->plan.kchunk);
    const int64_t kstop = min64(it.kend, (split + 1) * jb->plan.kchunk);
    float *part = jb->partial + item * (2 * BQ + BQ * jb->plan.ldacc);
    for (int i = 0; i < BQ; i++) {
        part[i] = -INFINITY;
        part[BQ + i] = 0.0f;
    }
    if (it.nq > 0 && kbeg < kstop) attnx_online_item(jb, s, &it, kbeg, kstop, part);
}

static void free_scratch(fwd_job *jb, int taken)
{
    for (int t = 0; t < taken; t++) attnx_scratch_give_back(t, jb->scr[t].qt);
    free(jb->scr);
    free(jb->partial);
}

/* One scratch per thread, and the split-K partials. */
static attnx_status alloc_scratch(fwd_job *jb)
{
    const int nt = jb->plan.threads;
    if (jb->plan.partial && !(jb->partial = attnx_alloc_floats(jb->plan.partial)))
        return ATTNX_ERR_NOMEM;
    if (!(jb->scr = calloc((size_t)nt, sizeof(fwd_scratch)))) {
        free_scratch(jb, 0);
        return ATTNX_ERR_NOMEM;
    }
    for (int t = 0; t < nt; t++) {
        float *base = attnx_scratch_take(t, jb->plan.scratch);
        if (!base) {
            free_scratch(jb, t);
            return ATTNX_ERR_NOMEM;
        }
        jb->scr[t] = attnx_fwd_scratch_at(base, jb->run.p, jb->plan.ldacc);
    }
    return ATTNX_OK;
}

/* Nothing to compute: no output rows, or rows of width 0 and nothing else asked. */
static int nothing_to_do(const attnx_problem *p)
{
    return p->B == 0 || p->Hq == 0 || p->Lq == 0 || (p->Dv == 0 && !p->weights && !p->lse.data);
}

attnx_status attnx_forward(const attnx_problem *p)
{
    attnx_status st = attnx_check_problem(p, NULL);
    if (st != ATTNX_OK || nothing_to_do(p)) return st;
    fwd_job jb = {.run = attnx_run_of(p)};
    if ((st = attnx_plan_forward(p, &jb.plan)) != ATTNX_OK) return st;
    if ((st = alloc_scratch(&jb)) != ATTNX_OK) return st;
    attnx_parallel_items(jb.plan.threads, jb.plan.n_items, run_item, &jb);
    if (jb.plan.nsplit > 1) attnx_merge_partials(&jb);
    free_scratch(&jb, jb.plan.threads);
    return ATTNX_OK;
}
