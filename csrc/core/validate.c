/* Validation: what the core needs to run a problem without reading or
 * writing outside the arrays described, checked before anything is written.
 * Each check names the member of the problem at fault, so that a caller can
 * say which of its arguments is wrong (python/problem.c does). */
#include <math.h>

#include "core/core.h"

static attnx_status refuse(const char **field, const char *name, attnx_status st)
{
    if (field) *field = name;
    return st;
}

static attnx_status check_sizes(const attnx_problem *p, const char **field)
{
    const int64_t sizes[] = {p->B, p->Hq, p->Hk, p->Lq, p->Lk, p->D, p->Dv};
    static const char *const names[] = {"B", "Hq", "Hk", "Lq", "Lk", "D", "Dv"};
    for (int i = 0; i < 7; i++)
        if (sizes[i] < 0) return refuse(field, names[i], ATTNX_ERR_SHAPE);
    if (p->Hq > 0 && (p->Hk == 0 || p->Hq % p->Hk != 0))
        return refuse(field, "Hk", ATTNX_ERR_SHAPE);
    return ATTNX_OK;
}

static attnx_status check_options(const attnx_problem *p, const char **field)
{
    if (p->mask.kind < ATTNX_MASK_NONE || p->mask.kind > ATTNX_MASK_FLOAT)
        return refuse(field, "mask.kind", ATTNX_ERR_ARG);
    if (p->causal < ATTNX_CAUSAL_NONE || p->causal > ATTNX_CAUSAL_LOWER_RIGHT)
        return refuse(field, "causal", ATTNX_ERR_ARG);
    if (!isfinite(p->scale)) return refuse(field, "scale", ATTNX_ERR_ARG);
    if (p->align < ATTNX_ALIGN_UPPER_LEFT || p->align > ATTNX_ALIGN_LOWER_RIGHT)
        return refuse(field, "align", ATTNX_ERR_ARG);
    /* 0: none; NaN fails too; a cap so small that its reciprocal overflows would
     * give inf · 0 = NaN in the scores */
    if (!(p->softcap >= 0.0f && p->softcap < INFINITY) ||
        (p->softcap > 0.0f && !(1.0f / p->softcap < INFINITY)))
        return refuse(field, "softcap", ATTNX_ERR_ARG);
    if (p->half_format != ATTNX_HALF_F16 && p->half_format != ATTNX_HALF_BF16)
        return refuse(field, "half_format", ATTNX_ERR_ARG);
    if (p->precision < ATTNX_PRECISION_HIGHEST || p->precision > ATTNX_PRECISION_MEDIUM)
        return refuse(field, "precision", ATTNX_ERR_ARG);
    return ATTNX_OK;
}

/* The arrays used: out (when the forward writes it) and q when there are
 * query rows, k and v when there are keys too, the mask when it has elements. */
static attnx_status check_pointers(const attnx_problem *p, int writes_out, const char **field)
{
    if (p->B == 0 || p->Hq == 0 || p->Lq == 0) return ATTNX_OK;
    if (writes_out && !p->out.data && p->Dv > 0) return refuse(field, "out.data", ATTNX_ERR_NULL);
    if (!p->q.data && p->D > 0) return refuse(field, "q.data", ATTNX_ERR_NULL);
    if (p->Lk == 0) return ATTNX_OK;
    if (p->k8.data) { /* int8 keys and values replace k and v */
        if (p->k16.data) return refuse(field, "k16.data", ATTNX_ERR_ARG); /* one format */
        if (!p->k8.scale) return refuse(field, "k8.scale", ATTNX_ERR_NULL);
        /* whatever Dv: the values' scales are read (pv_i8) even for Dv = 0 */
        if (!p->v8.data) return refuse(field, "v8.data", ATTNX_ERR_NULL);
        if (!p->v8.scale) return refuse(field, "v8.scale", ATTNX_ERR_NULL);
    } else if (p->k16.data) { /* half-precision keys and values replace k and v */
        if (!p->v16.data && p->Dv > 0) return refuse(field, "v16.data", ATTNX_ERR_NULL);
    } else {
        if (!p->k.data && p->D > 0) return refuse(field, "k.data", ATTNX_ERR_NULL);
        if (!p->v.data && p->Dv > 0) return refuse(field, "v.data", ATTNX_ERR_NULL);
    }
    if (p->mask.kind != ATTNX_MASK_NONE && !p->mask.data)
        return refuse(field, "mask.data", ATTNX_ERR_NULL);
    return ATTNX_OK;
}

/* Every length of a (B, H) array within [0, limit]. */
static int lengths_within(const attnx_lengths *len, int64_t B, int64_t H, int64_t limit)
{
    if (!len->data) return 1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t x = len->data[b * len->sb + h * len->sh];
            if (x < 0 || x > limit) return 0;
        }
    return 1;
}

static attnx_status check_lengths(const attnx_problem *p, const char **field)
{
    if (!lengths_within(&p->key_lengths, p->B, p->Hq, p->Lk))
        return refuse(field, "key_lengths", ATTNX_ERR_LENGTH);
    if (!lengths_within(&p->query_lengths, p->B, p->Hq, p->Lq))
        return refuse(field, "query_lengths", ATTNX_ERR_LENGTH);
    return ATTNX_OK;
}

/* Every element count the core indexes must fit in size_t bytes. */
static attnx_status check_overflow(const attnx_problem *p, const char **field)
{
    size_t n;
    if (!mul_ok((size_t)p->B, (size_t)p->Hq, &n) || !mul_ok(n, (size_t)p->Lq, &n) ||
        !mul_ok(n, (size_t)(p->Lk > p->Dv ? p->Lk : p->Dv), &n) || !mul_ok(n, sizeof(float), &n))
        return refuse(field, "size", ATTNX_ERR_OVERFLOW);
    return ATTNX_OK;
}

/* Pages: rows in a page, a pool when there are keys, and the first
 * ceil(Lk / size) entries of each table row in [0, num_pages). */
static attnx_status check_pages(const attnx_problem *p, const char **field)
{
    const attnx_pages *pg = &p->pages;
    if (!pg->table) return ATTNX_OK;
    if (pg->size < 1) return refuse(field, "pages.size", ATTNX_ERR_PAGE);
    if (p->Lk == 0 || p->B == 0 || p->Hk == 0) return ATTNX_OK;
    const int64_t used =
        p->Lk / pg->size + (p->Lk % pg->size != 0); /* no overflow near INT64_MAX */
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t x = 0; x < used; x++) {
            const int32_t page = pg->table[b * pg->sb + x];
            if (page < 0 || page >= pg->num_pages)
                return refuse(field, "pages.table", ATTNX_ERR_PAGE);
        }
    return ATTNX_OK;
}

/* The checks in order; the first that fails decides. */
static attnx_status check(const attnx_problem *p, int writes_out, const char **field)
{
    if (field) *field = NULL;
    if (!p) return refuse(field, "problem", ATTNX_ERR_NULL);
    attnx_status st = check_sizes(p, field);
    if (st == ATTNX_OK) st = check_options(p, field);
    if (st == ATTNX_OK) st = check_pointers(p, writes_out, field);
    if (st == ATTNX_OK) st = check_lengths(p, field);
    if (st == ATTNX_OK) st = check_overflow(p, field);
    if (st == ATTNX_OK) st = check_pages(p, field);
    return st;
}

attnx_status attnx_check_problem(const attnx_problem *p, const char **field)
{
    return check(p, 1, field);
}

/* The backward reads o, dout and lse of every query row, and writes dq, and
 * dk and dv of every key. */
static attnx_status check_grad_pointers(const attnx_grad_problem *g, const char **field)
{
    const attnx_problem *p = &g->f;
    if (p->B > 0 && p->Hq > 0 && p->Lq > 0) {
        if (p->Dv > 0 && !g->o.data) return refuse(field, "o.data", ATTNX_ERR_NULL);
        if (p->Dv > 0 && !g->dout.data) return refuse(field, "dout.data", ATTNX_ERR_NULL);
        if (!g->lse.data) return refuse(field, "lse.data", ATTNX_ERR_NULL);
        if (p->D > 0 && !g->dq.data) return refuse(field, "dq.data", ATTNX_ERR_NULL);
    }
    if (p->B > 0 && p->Hk > 0 && p->Lk > 0) {
        if (p->D > 0 && !g->dk.data) return refuse(field, "dk.data", ATTNX_ERR_NULL);
        if (p->Dv > 0 && !g->dv.data) return refuse(field, "dv.data", ATTNX_ERR_NULL);
    }
    return ATTNX_OK;
}

attnx_status attnx_check_grad_problem(const attnx_grad_problem *g, const char **field)
{
    if (field) *field = NULL;
    if (!g) return refuse(field, "problem", ATTNX_ERR_NULL);
    const attnx_status st = check(&g->f, 0, field);
    if (st != ATTNX_OK) return st;
    if (g->f.k16.data) return refuse(field, "f.k16", ATTNX_ERR_ARG); /* forward only */
    if (g->f.k8.data) return refuse(field, "f.k8", ATTNX_ERR_ARG);
    if (g->f.pages.table) return refuse(field, "f.pages", ATTNX_ERR_ARG);
    return check_grad_pointers(g, field);
}
