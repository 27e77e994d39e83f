/* The forward driver: FlashAttention-style attention over tiles, calling the
 * kernels of the active instruction set through their table (kernels.h).
 *
 *   check (validate.c) → plan (plan.c) → scratch (scratch.c)
 *   → the items over the thread pool (items.c, tile.c, output.c); with
 *     float32 on AMX tiles, each head's after its keys and values are
 *     split into bfloat16 parts, one pipeline (below)
 *   → split-K partials merged (output.c)
 *
 * With too few query blocks to occupy every thread (decoding), the keys are
 * split across threads too and the partial softmaxes merged (split-K). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

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
    /* split-K: this item's range of keys, and where its state goes (emptied
     * when the item's rows attend to none of the range's keys) */
    int64_t kbeg, kstop;
    attnx_range_keys(jb, split, it.kbeg, it.kend, &kbeg, &kstop);
    double *part = jb->partial + item * (int64_t)attnx_sum_state_size(&jb->plan);
    if (it.nq > 0 && kbeg < kstop)
        attnx_online_item(jb, s, &it, kbeg, kstop, part);
    else
        attnx_sum_clear(jb, attnx_sum_state(jb, part), it.rows);
}

static void free_scratch(fwd_job *jb, int taken)
{
    for (int t = 0; t < taken; t++) attnx_scratch_give_back(t, jb->scr[t].qt);
    free(jb->scr);
    free(jb->partial);
    free(jb->sums);
    free(jb->kspecial); /* and vspecial; the parts are the caller's */
}

/* One scratch per thread, and the split-K partials. */
static attnx_status alloc_scratch(fwd_job *jb)
{
    const int nt = jb->plan.threads;
    const size_t state = attnx_sum_state_size(&jb->plan);
    if (jb->plan.partial && !(jb->partial = malloc(sizeof(double) * jb->plan.partial)))
        return ATTNX_ERR_NOMEM;
    if (jb->plan.sums && !(jb->sums = malloc(sizeof(double) * 2 * state * (size_t)nt))) {
        free(jb->partial);
        return ATTNX_ERR_NOMEM;
    }
    if (jb->plan.kparts) { /* the key parts, then the value parts: the caller's buffer */
        const size_t values = (jb->plan.kparts + jb->plan.vparts + 1) / 2;
        float *parts = attnx_caller_buffer(ATTNX_CALLER_PARTS, values);
        jb->kspecial = parts ? calloc((size_t)jb->plan.split_heads, 2) : NULL;
        if (jb->kspecial) {
            jb->kparts = (uint16_t *)parts;
            jb->vparts = jb->plan.vparts ? jb->kparts + jb->plan.kparts : NULL;
            jb->vspecial = jb->kspecial + jb->plan.split_heads;
        } else { /* no memory for the parts: the FMAs, which need none */
            jb->run.split_dp = 0;
            jb->run.split_pv = 0;
            if (jb->run.round_dk) jb->run.round_dk = jb->run.pv_tiles = jb->run.pv_medium = 0;
        }
    }
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
        jb->scr[t] = attnx_fwd_scratch_at(base, jb->run.p, jb->plan.ldacc, jb->run.split_dp,
                                          jb->run.split_pv || jb->run.round_dk);
        jb->scr[t].sums = jb->sums ? jb->sums + (size_t)t * 2 * state : NULL;
    }
    return ATTNX_OK;
}

/* The keys of head bh = b·Hk + hk split into their bfloat16 parts
 * (kt->split_rows) in slot x, once for every query block that meets them;
 * the rows past Lk are 0. 16-bit keys are converted a tile at a time first
 * (kt->half_rows, into the thread's kbuf), as the tiles of qk read them. */
static void split_keys(const fwd_job *jb, int tid, int64_t bh, int64_t x)
{
    const attnx_problem *p = jb->run.p;
    const int64_t b = bh / p->Hk, hk = bh % p->Hk, dp = jb->run.split_dp;
    const int64_t part = jb->plan.kp_rows * dp;
    uint16_t *parts = jb->kparts + x * 3 * part;
    int special = 0;
    for (int64_t j0 = 0; j0 < p->Lk; j0 += BK) { /* whole blocks of 16 rows but the last */
        const int nk = (int)min64(BK, p->Lk - j0);
        int64_t k_sl;
        const float *k = attnx_kv_rows(&jb->run, 0, b, hk, j0, nk, jb->scr[tid].kbuf, &k_sl);
        special |= jb->run.kt->split_rows(k, k_sl, nk, p->D, parts + j0 * dp, part, dp);
    }
    jb->kspecial[x] = (unsigned char)special;
    const int64_t done = ATTNX_ROUND16(p->Lk) * dp;
    for (int a = 0; a < 3; a++)
        memset(parts + a * part + done, 0, sizeof *parts * (size_t)(part - done));
}

/* The values of head bh split into their parts in slot x and transposed,
 * (3, Dv, ldv) (kt->pv_split's vt), BQ keys at a time:
 * transposed by pack_qt into the thread's acc (Dv, BQ), then split by
 * split_rows into their columns of the parts; keys past Lk are 0 (a tile
 * that starts at an unaligned key, in a causal or window band, reads up
 * to 31 past its last). 16-bit values are converted first (vbuf). */
static void split_values(const fwd_job *jb, int tid, int64_t bh, int64_t x)
{
    const fwd_scratch *s = &jb->scr[tid];
    const attnx_problem *p = jb->run.p;
    const int64_t b = bh / p->Hk, hk = bh % p->Hk, Dv = p->Dv;
    const int64_t ldv = jb->plan.ldv, part = Dv * ldv; /* Dv % 16 == 0 */
    uint16_t *parts = jb->vparts + x * 3 * part;
    int special = 0;
    for (int64_t j0 = 0; j0 < ldv; j0 += BQ) {
        const int nk = (int)clamp64(p->Lk - j0, 0, BQ), done = (nk + 31) / 32 * 32;
        if (nk) {
            int64_t v_sl;
            const float *v = attnx_kv_rows(&jb->run, 1, b, hk, j0, nk, s->vbuf, &v_sl);
            jb->run.kt->pack_qt(v, v_sl, nk, Dv, 1.0f, s->acc, BQ);
            /* nk columns of the (Dv, BQ) values split, zeroed on to 32 */
            special |= jb->run.kt->split_rows(s->acc, BQ, (int)Dv, nk, parts + j0, part, ldv);
        }
        if (done < BQ)
            for (int64_t r = 0; r < 3 * Dv; r++) /* the 3 parts' rows, part = Dv rows */
                memset(parts + r * ldv + j0 + done, 0, sizeof *parts * (size_t)(BQ - done));
    }
    jb->vspecial[x] = (unsigned char)special;
}

/* Precision "medium" (round_dk): the keys and values of head bh rounded to
 * bfloat16 in slot x, rows (kp_rows, round_dk) and (kp_rows, Dv), a tile
 * at a time (16-bit and int8 ones converted first, as the FMAs' tiles read
 * them); the rows past Lk are 0 (qk_bf16 and pv_medium read only nk rows,
 * but AMX's reads whole blocks of 16). */
static void round_keys_values(const fwd_job *jb, int tid, int64_t bh, int64_t x)
{
    const fwd_scratch *s = &jb->scr[tid];
    const attnx_problem *p = jb->run.p;
    const int64_t b = bh / p->Hk, hk = bh % p->Hk, dk = jb->run.round_dk, rows = jb->plan.kp_rows;
    uint16_t *keys = jb->kparts + x * rows * dk, *values = jb->vparts + x * rows * p->Dv;
    int kover = 0, vover = 0;
    for (int64_t j0 = 0; j0 < p->Lk; j0 += BK) {
        const int nk = (int)min64(BK, p->Lk - j0);
        int64_t sl;
        const float *k = attnx_kv_rows(&jb->run, 0, b, hk, j0, nk, s->kbuf, &sl);
        kover |= jb->run.kt->round_rows(k, sl, nk, p->D, keys + j0 * dk, dk);
        const float *v = attnx_kv_rows(&jb->run, 1, b, hk, j0, nk, s->vbuf, &sl);
        vover |= jb->run.kt->round_rows(v, sl, nk, p->Dv, values + j0 * p->Dv, p->Dv);
    }
    memset(keys + p->Lk * dk, 0, sizeof *keys * (size_t)((rows - p->Lk) * dk));
    memset(values + p->Lk * p->Dv, 0, sizeof *values * (size_t)((rows - p->Lk) * p->Dv));
    jb->kspecial[x] = (unsigned char)kover;
    jb->vspecial[x] = (unsigned char)vover;
}

/* With parts (float32 on AMX tiles, or rounded under "medium") the call is
 * one pipeline of tasks,
 * taken in order: each head's split into its slot, interleaved with the
 * items, so that one thread splits while the others compute, with no
 * barrier between heads, and a head's parts are split just before its
 * items read them (in cache). With S(h) the split of head h and I(h) its
 * items, and 1 slot: S(0) I(0) S(1) I(1) .. S(H-1) I(H-1); with more,
 * S(0) and then S(h + 1) half-way through I(h), up to I(H-1). An item
 * waits until its head's parts are ready; a split waits until every item
 * of the head whose slot it takes (h - slots) is done, which with 2 slots
 * were handed out half a head's items before. Both wait only on tasks
 * taken before them, so some running thread holds each. */
typedef struct {
    int64_t head; /* its key/value head, b·Hk + hk */
    int64_t item; /* the item of that head, or -1: the head's split */
} pipeline_task;

/* Task t of the pipeline over `heads` heads of `per` items each. */
static pipeline_task task_at(const fwd_job *jb, int64_t heads, int64_t per, int64_t t)
{
    const int64_t ahead = jb->plan.split_heads > 1; /* splits ahead of the items */
    pipeline_task k;
    if (t < ahead) { /* S(0) */
        k.head = t, k.item = -1;
        return k;
    }
    t -= ahead; /* blocks of the items I(h) with S(h + ahead) at m, then items only */
    const int64_t with_split = (heads - ahead) * (per + 1), m = ahead ? per / 2 : 0;
    if (t < with_split) {
        const int64_t h = t / (per + 1), r = t % (per + 1);
        k.head = r == m ? h + ahead : h;
        k.item = r == m ? -1 : r < m ? r : r - 1;
        return k;
    }
    t -= with_split;
    k.head = heads - ahead + t / per, k.item = t % per;
    return k;
}

static void run_task(void *arg, int tid, int64_t t)
{
    fwd_job *jb = arg;
    const int64_t heads = jb->run.p->B * jb->run.p->Hk, per = jb->plan.n_items / heads;
    const pipeline_task k = task_at(jb, heads, per, t);
    const int64_t x = k.head % jb->plan.split_heads;
    if (k.item >= 0) {
        attnx_wait_for(&jb->ready[x], k.head + 1);
        run_item(jb, tid, k.head * per + k.item);
        atomic_fetch_add_explicit(&jb->done[x], 1, memory_order_release);
        return;
    }
    if (k.head >= jb->plan.split_heads) attnx_wait_for(&jb->done[x], per); /* its last head's */
    atomic_store_explicit(&jb->done[x], 0, memory_order_relaxed);
    if (jb->run.round_dk) {
        round_keys_values(jb, tid, k.head, x);
    } else {
        split_keys(jb, tid, k.head, x);
        if (jb->vparts) split_values(jb, tid, k.head, x);
    }
    atomic_store_explicit(&jb->ready[x], k.head + 1, memory_order_release);
}

/* Nothing to compute: no output rows, or rows of width 0 and nothing else asked. */
static int nothing_to_do(const attnx_problem *p)
{
    return p->B == 0 || p->Hq == 0 || p->Lq == 0 || (p->Dv == 0 && !p->weights && !p->lse.data);
}

/* Key lengths equal within every group of G query heads (read once here:
 * another thread changing them meanwhile changes the result, never the
 * memory reached). */
static int lengths_equal_in_groups(const attnx_problem *p, int64_t G)
{
    const attnx_lengths *kl = &p->key_lengths;
    if (!kl->data || kl->sh == 0) return 1;
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t h = 0; h < p->Hq; h++)
            if (length_of(kl, b, h, p->Lk) != length_of(kl, b, h - h % G, p->Lk)) return 0;
    return 1;
}

/* Decoding with grouped-query attention: one query row per head (Lq = 1),
 * each key/value head shared by a group of G = Hq / Hk query heads. As items
 * of their own, the G heads would each read their key/value head from
 * memory, G reads of the same bytes. Folded, the group becomes G query rows
 * of one head: the problem (B, Hk, G, D) against (B, Hk, Lk, D), every key
 * and value row read once for the group (as transformers' pack_gqa). Query
 * head h = hk·G + g is row g of head hk, so every array indexed by
 * (b, h, i = 0) is the same memory with strides (sb, G·sh, sh). A group
 * that fits the row kernels (G <= dot_max_nq) computes each row as alone,
 * the same bits; a larger one takes the tiled kernels (another order of
 * the same sums, within float32's tolerances). Only when nothing depends on the
 * query's position or differs within a group in a way strides cannot say:
 * no window, ALiBi, sinks or query lengths, and key lengths equal within
 * each group. A lower-right causal mask lets the one query see every key
 * (as none); the upper-left one only key 0: that one is not folded.
 * Returns 1 if *f holds the folded problem. */
static int fold_gqa_decode(const attnx_problem *p, attnx_problem *f)
{
    if (p->Lq != 1 || p->Hq == p->Hk || p->Hk == 0 || p->causal == ATTNX_CAUSAL_UPPER_LEFT ||
        p->window.on || p->alibi.data || p->sinks.data || p->query_lengths.data)
        return 0;
    const int64_t G = p->Hq / p->Hk;
    if (!lengths_equal_in_groups(p, G)) return 0;
    *f = *p;
    f->Hq = p->Hk;
    f->Lq = G;
    f->causal = ATTNX_CAUSAL_NONE;
    f->q.sl = p->q.sh, f->q.sh = G * p->q.sh;
    f->out.sl = p->out.sh, f->out.sh = G * p->out.sh;
    f->lse.sl = p->lse.sh, f->lse.sh = G * p->lse.sh;
    f->mask.sq = p->mask.sh, f->mask.sh = G * p->mask.sh;
    f->key_lengths.sh = G * p->key_lengths.sh;
    f->mask_map.data = NULL; /* a map of the unfolded axes: classified again */
    return 1; /* weights (B, Hq, 1, Lk) C-contiguous are (B, Hk, G, Lk) C-contiguous */
}

attnx_status attnx_forward(const attnx_problem *p)
{
    attnx_status st = attnx_check_problem(p, NULL);
    if (st != ATTNX_OK || nothing_to_do(p)) return st;
    attnx_problem folded;
    if (fold_gqa_decode(p, &folded)) p = &folded;
    fwd_job jb = {.run = attnx_run_of(p)};
    for (int x = 0; x < ATTNX_SPLIT_SLOTS; x++) {
        atomic_init(&jb.ready[x], 0);
        atomic_init(&jb.done[x], 0);
    }
    if ((st = attnx_plan_forward(&jb.run, &jb.plan)) != ATTNX_OK) return st;
    attnx_note_threads(jb.plan.threads);
    uint8_t *map = NULL;
    if ((st = attnx_run_map(&jb.run, jb.plan.threads, &map)) != ATTNX_OK) return st;
    /* the ranges of long sums, cut by a mask's kept work or evenly: not by
     * the threads (core.h) */
    jb.kbounds = attnx_balanced_ranges(&jb.run, jb.plan.nranges, jb.plan.kchunk);
    if ((st = alloc_scratch(&jb)) != ATTNX_OK) {
        free(jb.kbounds);
        free(map);
        return st;
    }
    if (!jb.kparts)
        attnx_parallel_items(jb.plan.threads, jb.plan.n_items, run_item, &jb);
    else /* every head's split and items */
        attnx_parallel_items(jb.plan.threads, p->B * p->Hk + jb.plan.n_items, run_task, &jb);
    if (jb.plan.nsplit > 1) attnx_merge_partials(&jb);
    free_scratch(&jb, jb.plan.threads);
    free(jb.kbounds);
    free(map);
    return ATTNX_OK;
}

/* ---- many problems ---------------------------------------------------------- */

typedef struct {
    const attnx_problem *problems;
    const int64_t *small; /* the indexes of the problems that run on one thread */
    atomic_int status;
} batch_job;

static void run_small(void *arg, int tid, int64_t i)
{
    batch_job *bj = arg;
    attnx_problem p = bj->problems[bj->small[i]];
    p.num_threads = 1; /* inside the pool: runs on this thread */
    const attnx_status st = attnx_forward(&p);
    int ok = ATTNX_OK;
    if (st != ATTNX_OK) atomic_compare_exchange_strong(&bj->status, &ok, (int)st);
}

static double flops_of(const attnx_problem *p)
{
    return 4.0 * (double)p->B * (double)p->Hq * (double)p->Lq * (double)p->Lk *
           (double)(p->D > 0 ? p->D : 1);
}

attnx_status attnx_forward_batch(const attnx_problem *problems, int64_t n, int num_threads)
{
    const int nt = num_threads > 0 ? num_threads : attnx_get_num_threads();
    int64_t *small = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    if (!small) return ATTNX_ERR_NOMEM;
    int64_t n_small = 0;
    attnx_status st = ATTNX_OK;
    for (int64_t i = 0; i < n && st == ATTNX_OK; i++) {
        if (flops_of(&problems[i]) < ATTNX_BATCH_ALONE_FLOPS && nt > 1)
            small[n_small++] = i;
        else
            st = attnx_forward(&problems[i]);
    }
    if (st == ATTNX_OK && n_small > 0) {
        batch_job bj = {.problems = problems, .small = small};
        atomic_init(&bj.status, ATTNX_OK);
        attnx_parallel_items((int)min64(nt, n_small), n_small, run_small, &bj);
        st = (attnx_status)atomic_load(&bj.status);
    }
    free(small);
    return st;
}
