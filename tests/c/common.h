/* What the plain C tests share: a small deterministic random generator.
 * Each test file sets rng_state to its own seed before using it. */
#ifndef ATTNX_TEST_COMMON_H
#define ATTNX_TEST_COMMON_H

#include <stdint.h>

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static double urand(void) /* xorshift64*, uniform in [0, 1) */
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 2685821657736338717ull) >> 11) / 9007199254740992.0;
}

/* roughly normal, in (-3, 3) */
static float nrand(void) { return (float)((urand() + urand() + urand() - 1.5) * 2.0); }

#endif
