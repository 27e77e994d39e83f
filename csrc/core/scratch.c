/* Scratch memory: one buffer per thread for the duration of a call, carved
 * into the working set of a forward item or a backward block. */
#include <pthread.h>
#include <stdlib.h>

#include "core/core.h"
#include "core/platform.h"

float *attnx_alloc_floats(size_t n)
{
    size_t bytes;
    if (!mul_ok(n, sizeof(float), &bytes)) return NULL;
    return attnx_os_aligned_alloc(bytes);
}

void attnx_free_floats(float *p) { attnx_os_aligned_free(p); }

/* The calling thread's buffers, one a use (attnx_caller_use), kept between
 * calls and freed when the thread exits. */
static pthread_key_t cache_key;
static pthread_once_t cache_once = PTHREAD_ONCE_INIT;
typedef struct {
    float *buf[ATTNX_CALLER_USES];
    size_t cap[ATTNX_CALLER_USES];
} cache;

static void cache_free(void *c)
{
    if (c)
        for (int u = 0; u < ATTNX_CALLER_USES; u++) attnx_free_floats(((cache *)c)->buf[u]);
    free(c);
}

static void cache_init(void) { (void)pthread_key_create(&cache_key, cache_free); }

#ifdef ATTNX_TEST_HOOKS
/* tests/c (built with -DATTNX_TEST_HOOKS): nonzero makes the parts' buffer
 * unavailable, as when there is no memory for it */
int attnx_test_no_parts = 0;
#endif

float *attnx_caller_buffer(attnx_caller_use use, size_t n)
{
#ifdef ATTNX_TEST_HOOKS
    if (use == ATTNX_CALLER_PARTS && attnx_test_no_parts) return NULL;
#endif
    pthread_once(&cache_once, cache_init);
    cache *c = pthread_getspecific(cache_key);
    if (!c) {
        if (!(c = calloc(1, sizeof *c))) return NULL;
        if (pthread_setspecific(cache_key, c) != 0) {
            free(c);
            return NULL;
        }
    }
    if (c->cap[use] < n) {
        float *b = attnx_alloc_floats(n);
        if (!b) return NULL;
        attnx_free_floats(c->buf[use]);
        c->buf[use] = b;
        c->cap[use] = n;
    }
    return c->buf[use];
}

float *attnx_scratch_take(int tid, size_t n)
{
    return tid == 0 ? attnx_caller_buffer(ATTNX_CALLER_SCRATCH, n) : attnx_alloc_floats(n);
}

void attnx_scratch_give_back(int tid, float *buf)
{
    if (tid != 0) attnx_free_floats(buf); /* thread 0's stays cached */
}

/* kbuf and vbuf: a tile of keys and values converted from 16 bits, or
 * copied from several pages */
static int staged_kv(const attnx_problem *p) { return p->k16.data || p->k8.data || p->pages.table; }

attnx_status attnx_fwd_scratch_size(const attnx_problem *p, int64_t ldacc, int64_t split_dp,
                                    int acct, size_t *floats)
{
    size_t main, kv = 0, tiles = 0;
    const size_t qparts = 3 * (size_t)(split_dp / 2) * BQ; /* split_dp <= D + 31: no overflow */
    if (!mul_ok((size_t)p->D + BK + (size_t)ldacc + 3, BQ, &main) ||
        (staged_kv(p) && !mul_ok((size_t)p->D + (size_t)p->Dv, BK, &kv)) || main > SIZE_MAX - kv)
        return ATTNX_ERR_OVERFLOW;
    if (all_bf16(p) || acct) { /* acct (ldacc, BQ), pv_work: ATTNX_PV_BF16_WORK(ldacc) */
        if (!mul_ok((size_t)ldacc, BQ + BK / 2, &tiles) ||
            tiles > SIZE_MAX - (size_t)ATTNX_PV_BF16_WORK(0))
            return ATTNX_ERR_OVERFLOW;
        tiles += (size_t)ATTNX_PV_BF16_WORK(0);
    }
    if (main + kv > SIZE_MAX - tiles || main + kv + tiles > SIZE_MAX - qparts)
        return ATTNX_ERR_OVERFLOW;
    *floats = main + kv + tiles + qparts;
    return ATTNX_OK;
}

fwd_scratch attnx_fwd_scratch_at(float *base, const attnx_problem *p, int64_t ldacc,
                                 int64_t split_dp, int acct)
{
    fwd_scratch s;
    s.qt = base;
    s.st = s.qt + (size_t)p->D * BQ;
    s.acc = s.st + (size_t)BK * BQ;
    s.m = s.acc + (size_t)ldacc * BQ;
    s.l = s.m + BQ;
    s.alpha = s.l + BQ;
    s.kbuf = s.vbuf = s.acct = s.pv_work = NULL;
    if (staged_kv(p)) {
        s.kbuf = s.alpha + BQ;
        s.vbuf = s.kbuf + (size_t)BK * p->D;
    }
    float *end = s.alpha + BQ + (staged_kv(p) ? (size_t)BK * (size_t)(p->D + p->Dv) : 0);
    if (all_bf16(p) || acct) { /* 64-byte aligned: every offset is a multiple of 16 floats */
        s.acct = end;
        s.pv_work = s.acct + (size_t)ldacc * BQ;
        end = s.pv_work + ATTNX_PV_BF16_WORK(0) + (size_t)ldacc * (BK / 2);
    }
    s.qparts = split_dp ? (uint32_t *)end : NULL; /* 64-byte aligned, as above */
    return s;
}

attnx_status attnx_bwd_scratch_size(const attnx_problem *p, const bwd_plan *plan, size_t *floats)
{
    size_t main;
    if (!mul_ok((size_t)p->D + (size_t)p->Dv + 3 * BK + (size_t)plan->ldqa + 3, BQ, &main))
        return ATTNX_ERR_OVERFLOW;
    const size_t dims = (size_t)(plan->split_dp + plan->split_dpv),
                 rows = BQ + (size_t)plan->kslice + 16;
    size_t parts = 0, runs = 0; /* runs: kslice <= BWD_RUN_FLOATS / (ldqa + ldva), or BK */
    /* 3 parts: 3/2 floats a dim and row; 1: a float a dim of the BQ rows (packed
     * before the pairs), 1/2 of the others: at most as much */
    if (plan->split_dp && (!mul_ok(3 * dims / 2, rows, &parts) || parts > SIZE_MAX - main))
        return ATTNX_ERR_OVERFLOW;
    if (plan->run && (!mul_ok((size_t)plan->kslice, (size_t)(plan->ldqa + plan->ldva), &runs) ||
                      runs > SIZE_MAX - main - parts))
        return ATTNX_ERR_OVERFLOW;
    size_t medium = 0; /* ptx_medium: qrows, orows (BQ rows of ldqa, ldva) and tbf (BK·BQ / 2) */
    if (plan->ptx_medium && (!mul_ok((size_t)(plan->ldqa + plan->ldva) + BK / 2, BQ, &medium) ||
                             medium > SIZE_MAX - main - parts - runs))
        return ATTNX_ERR_OVERFLOW;
    *floats = main + parts + runs + medium;
    return ATTNX_OK;
}

bwd_scratch attnx_bwd_scratch_at(float *base, const attnx_problem *p, const bwd_plan *plan)
{
    bwd_scratch s;
    s.qt = base;
    s.dot = s.qt + (size_t)p->D * BQ;
    s.st = s.dot + (size_t)p->Dv * BQ;
    s.dpt = s.st + (size_t)BK * BQ;
    s.capped = s.dpt + (size_t)BK * BQ;
    s.dqacc = s.capped + (size_t)BK * BQ;
    s.lse = s.dqacc + (size_t)plan->ldqa * BQ;
    s.dvec = s.lse + BQ;
    s.ones = s.dvec + BQ;
    for (int i = 0; i < BQ; i++) s.ones[i] = 1.0f;
    float *end = s.ones + BQ;
    s.dkrun = s.dvrun = NULL;
    if (plan->run) { /* 64-byte aligned: kslice, ldqa and ldva are multiples of 16 */
        s.dkrun = end;
        s.dvrun = s.dkrun + (size_t)plan->kslice * (size_t)plan->ldqa;
        end = s.dvrun + (size_t)plan->kslice * (size_t)plan->ldva;
    }
    s.qparts = s.oparts = NULL;
    s.kparts = s.vparts = NULL;
    if (plan->split_dp) { /* 64-byte aligned: every size above is a multiple of 16 floats */
        const size_t dp = (size_t)plan->split_dp, dpv = (size_t)plan->split_dpv;
        const size_t n = (size_t)plan->parts, words = n > 1 ? n : 2; /* per 2 dims of a row */
        s.qparts = (uint32_t *)end;
        s.oparts = s.qparts + words * dp / 2 * BQ;
        s.kparts = (uint16_t *)(s.oparts + words * dpv / 2 * BQ);
        s.vparts = s.kparts + n * dp * ((size_t)plan->kslice + 16);
        end = (float *)(s.vparts + n * dpv * ((size_t)plan->kslice + 16));
    }
    s.qrows = s.orows = NULL;
    s.tbf = NULL;
    if (plan->ptx_medium) { /* 64-byte aligned: parts' sizes are multiples of 32 bfloat16 values */
        s.qrows = (uint32_t *)end;
        s.orows = s.qrows + (size_t)plan->ldqa * BQ;
        s.tbf = (uint16_t *)(s.orows + (size_t)plan->ldva * BQ);
    }
    return s;
}
