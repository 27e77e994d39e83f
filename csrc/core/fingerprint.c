/* A fast 64-bit fingerprint of bytes: how the Python package notices that an
 * array it kept a reference to (the inputs of a forward whose vjp may be
 * called later) was modified in place. Not cryptographic: any change of the
 * bytes, their order included, changes it except with probability ~2^-64.
 *
 * Four independent lanes take the 8-byte words of each 32-byte block in turn
 * (xor, multiply, rotate: a chain per lane, so the order of the blocks
 * matters); the lanes, the tail bytes and the length are mixed at the end.
 * Reading at the memory's speed matters more than the mixing: at ~10 bytes a
 * cycle it costs a fraction of one pass of attention over the same arrays. */
#include <stdlib.h>
#include <string.h>

#include "core/core.h"

#define PRIME1 0x9E3779B185EBCA87ULL
#define PRIME2 0xC2B2AE3D27D4EB4FULL

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t word(const unsigned char *p)
{
    uint64_t w;
    memcpy(&w, p, sizeof w); /* any alignment */
    return w;
}

static inline uint64_t mix(uint64_t lane, uint64_t w) { return rotl((lane ^ w) * PRIME1, 31); }

static uint64_t avalanche(uint64_t h)
{
    h ^= h >> 33;
    h *= PRIME2;
    h ^= h >> 29;
    h *= PRIME1;
    return h ^ (h >> 32);
}

uint64_t attnx_fingerprint(uint64_t seed, const void *data, size_t nbytes)
{
    const unsigned char *p = data;
    uint64_t a = seed ^ PRIME1, b = seed ^ PRIME2, c = ~seed, d = seed + PRIME1 * PRIME2;
    size_t i = 0;
    for (; i + 32 <= nbytes; i += 32) {
        a = mix(a, word(p + i));
        b = mix(b, word(p + i + 8));
        c = mix(c, word(p + i + 16));
        d = mix(d, word(p + i + 24));
    }
    uint64_t h = rotl(a, 1) + rotl(b, 7) + rotl(c, 12) + rotl(d, 18);
    for (; i + 8 <= nbytes; i += 8) h = mix(h, word(p + i));
    for (; i < nbytes; i++) h = mix(h, p[i]);
    return avalanche(h ^ (uint64_t)nbytes);
}

/* ---- large arrays, on the thread pool --------------------------------------
 * Fixed chunks of FP_CHUNK bytes, each fingerprinted with its index as seed
 * (on any thread), the chunks' values then fingerprinted in order: the result
 * depends on the bytes only, never on the thread count. */
#define FP_CHUNK ((size_t)1 << 18)
#define FP_POOLED ((size_t)64 << 20)

typedef struct {
    const unsigned char *data;
    size_t nbytes;
    uint64_t *parts;
} fp_job;

static void fp_chunk(void *arg, int tid, int64_t i)
{
    const fp_job *job = arg;
    const size_t at = (size_t)i * FP_CHUNK;
    const size_t n = job->nbytes - at < FP_CHUNK ? job->nbytes - at : FP_CHUNK;
    job->parts[i] = attnx_fingerprint((uint64_t)i, job->data + at, n);
}

uint64_t attnx_fingerprint_parallel(const void *data, size_t nbytes)
{
    const size_t chunks = (nbytes + FP_CHUNK - 1) / FP_CHUNK;
    uint64_t *parts = malloc(chunks * sizeof *parts);
    if (!parts) return attnx_fingerprint(0, data, nbytes) ^ 1; /* another, fixed, value */
    fp_job job = {.data = data, .nbytes = nbytes, .parts = parts};
    /* the pool only for arrays worth waking it (FP_POOLED): right after a
     * NumPy matmul, OpenBLAS's threads still spin, and a short section on two
     * vCPUs waited for a descheduled worker (MultiHeadAttention.vjp's six
     * fingerprints of 4 MiB made its step several times slower) */
    const int nt = nbytes >= FP_POOLED ? attnx_get_num_threads() : 1;
    attnx_parallel_items(nt < (int64_t)chunks ? nt : (int)chunks, (int64_t)chunks, fp_chunk, &job);
    const uint64_t h = attnx_fingerprint(nbytes, parts, chunks * sizeof *parts);
    free(parts);
    return h;
}
