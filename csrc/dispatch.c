/* Picks the kernel table once: the widest instruction set that the CPU and
 * the OS support, unless ATTNX_ISA=scalar|avx2|avx512|neon asks for another
 * (an unavailable request falls back to the best available one). */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "kernels.h"

#if defined(ATTNX_HAVE_X86) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>

static unsigned long long xgetbv0(void)
{
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

static int cpu_has_avx2(void)
{
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1;
    if (!(fma && osxsave && avx)) return 0;
    if ((xgetbv0() & 0x6) != 0x6) return 0;          /* OS saves XMM and YMM state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (b >> 5) & 1;                               /* AVX2 */
}

static int cpu_has_avx512(void)
{
    unsigned int a, b, c, d;
    if (!cpu_has_avx2()) return 0;
    if ((xgetbv0() & 0xe6) != 0xe6) return 0;        /* and opmask, ZMM state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int f = (b >> 16) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
    return f && bw && vl;
}
#elif defined(ATTNX_HAVE_X86)
static int cpu_has_avx2(void) { return 0; }      /* no cpuid.h: stay on the scalar path */
static int cpu_has_avx512(void) { return 0; }
#endif

static const attnx_kernels *table_for(const char *name)
{
    if (!name) return NULL;
    if (strcmp(name, "scalar") == 0) return &attnx_kernels_scalar;
#ifdef ATTNX_HAVE_X86
    if (strcmp(name, "avx2") == 0 && cpu_has_avx2()) return &attnx_kernels_avx2;
    if (strcmp(name, "avx512") == 0 && cpu_has_avx512()) return &attnx_kernels_avx512;
#endif
#ifdef ATTNX_HAVE_NEON
    if (strcmp(name, "neon") == 0) return &attnx_kernels_neon;
#endif
    return NULL;
}

static const attnx_kernels *best_table(void)
{
    const attnx_kernels *t = table_for(getenv("ATTNX_ISA"));
    if (t) return t;
    if ((t = table_for("avx512"))) return t;
    if ((t = table_for("neon"))) return t;
    if ((t = table_for("avx2"))) return t;
    return &attnx_kernels_scalar;
}

/* Set by attnx_set_isa() or on first use. Every value ever stored is a valid
 * table, so racing first uses are harmless; the pointer is atomic so that
 * they are not a data race. */
static _Atomic(const attnx_kernels *) active = NULL;

const attnx_kernels *attnx_active_kernels(void)
{
    const attnx_kernels *t = atomic_load(&active);
    if (!t) atomic_store(&active, t = best_table());
    return t;
}

const char *attnx_isa_name(void) { return attnx_active_kernels()->name; }

int attnx_isa_available(const char *name) { return table_for(name) != NULL; }

static const char *const isa_names[] = {"scalar", "avx2", "avx512", "neon"};

int attnx_isa_count(void) { return (int)(sizeof isa_names / sizeof *isa_names); }

const char *attnx_isa_name_at(int i) { return i >= 0 && i < attnx_isa_count() ? isa_names[i] : NULL; }

attnx_status attnx_set_isa(const char *name)
{
    const attnx_kernels *t = table_for(name);
    if (!t) return ATTNX_ERR_ISA;
    atomic_store(&active, t);
    return ATTNX_OK;
}
