/* What each status means, in words: one table, indexed by the status. */
#include "attnx.h"

static const char *const messages[] = {
    [ATTNX_OK] = "success",
    [ATTNX_ERR_NULL] = "a required array pointer is NULL",
    [ATTNX_ERR_SHAPE] =
        "invalid shape: a negative size, or query heads not a multiple of key/value heads",
    [ATTNX_ERR_ARG] =
        "invalid argument: mask kind or causal mode out of range, or scale not finite",
    [ATTNX_ERR_LENGTH] = "a key or query length lies outside [0, L]",
    [ATTNX_ERR_OVERFLOW] = "the problem is too large: its byte count overflows size_t",
    [ATTNX_ERR_NOMEM] = "out of memory for scratch buffers",
    [ATTNX_ERR_ISA] = "that instruction set is not available on this CPU or build",
    [ATTNX_ERR_PAGE] = "a page table entry lies outside the pool of pages, or a page has no rows",
};

const char *attnx_strerror(attnx_status status)
{
    const unsigned i = (unsigned)status;
    return i < sizeof messages / sizeof *messages && messages[i] ? messages[i] : "unknown error";
}
