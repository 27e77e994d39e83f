/* The instruction sets: one table of name, support probe and kernels, from
 * which the kernels in use are picked once: the widest instruction set that
 * the CPU and the OS support, unless ATTNX_ISA=scalar|avx2|avx512|neon asks
 * for another (an unavailable request falls back to the best available one).
 * A new instruction set is one row here, one kernels/<isa>.c and one line in
 * csrc/sources.txt. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "kernels/kernels.h"

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
    const int f16c = (c >> 29) & 1;
    if (!(fma && osxsave && avx && f16c)) return 0;
    if ((xgetbv0() & 0x6) != 0x6) return 0; /* OS saves XMM and YMM state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (b >> 5) & 1; /* AVX2 */
}

static int cpu_has_avx512(void)
{
    unsigned int a, b, c, d;
    if (!cpu_has_avx2()) return 0;
    if ((xgetbv0() & 0xe6) != 0xe6) return 0; /* and opmask, ZMM state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int f = (b >> 16) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
    return f && bw && vl;
}

/* AVX512_BF16 (vdpbf16ps): CPUID.(EAX=7, ECX=1):EAX bit 5, on top of AVX-512. */
static int cpu_has_avx512_bf16(void)
{
    unsigned int a, b, c, d;
    if (!cpu_has_avx512()) return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || a < 1) return 0; /* no leaf 7.1 */
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
    return (a >> 5) & 1;
}
#elif defined(ATTNX_HAVE_X86)
static int cpu_has_avx2(void) { return 0; } /* no cpuid.h: stay on the scalar path */
static int cpu_has_avx512(void) { return 0; }
static int cpu_has_avx512_bf16(void) { return 0; }
#endif

static int always(void) { return 1; }

/* Every instruction set the core knows, narrowest first: the default is the
 * last one available. NEON is part of the aarch64 baseline. */
const attnx_isa attnx_isas[] = {
    {.name = "scalar", .supported = always, .kernels = &attnx_kernels_scalar},
#ifdef ATTNX_HAVE_X86
    {.name = "avx2", .supported = cpu_has_avx2, .kernels = &attnx_kernels_avx2},
    {.name = "avx512",
     .supported = cpu_has_avx512,
     .kernels = &attnx_kernels_avx512,
     .bf16_supported = cpu_has_avx512_bf16,
     .kernels_bf16 = &attnx_kernels_avx512_bf16},
#else
    {.name = "avx2", .supported = NULL, .kernels = NULL},
    {.name = "avx512", .supported = NULL, .kernels = NULL},
#endif
#ifdef ATTNX_HAVE_NEON
    {.name = "neon", .supported = always, .kernels = &attnx_kernels_neon},
#else
    {.name = "neon", .supported = NULL, .kernels = NULL},
#endif
};
const int attnx_isa_total = (int)(sizeof attnx_isas / sizeof *attnx_isas);

static const attnx_isa *isa_named(const char *name)
{
    for (int i = 0; name && i < attnx_isa_total; i++)
        if (strcmp(attnx_isas[i].name, name) == 0) return &attnx_isas[i];
    return NULL;
}

static int usable(const attnx_isa *isa) { return isa && isa->kernels && isa->supported(); }

/* Each row's bf16_supported(), probed once (cpuid may trap to a hypervisor:
 * too slow for every call): 0 not yet, 1 no, 2 yes. */
static _Atomic int bf16_probed[sizeof attnx_isas / sizeof *attnx_isas];

/* The kernels of a usable instruction set: its table with qk_bf16 when the
 * CPU has the bfloat16 dot products. */
static const attnx_kernels *kernels_of(const attnx_isa *isa)
{
    if (!isa->kernels_bf16) return isa->kernels;
    _Atomic int *probed = &bf16_probed[isa - attnx_isas];
    int has = atomic_load(probed);
    if (!has) atomic_store(probed, has = isa->bf16_supported() ? 2 : 1);
    return has == 2 ? isa->kernels_bf16 : isa->kernels;
}

const attnx_kernels *attnx_isa_kernels(const char *name)
{
    const attnx_isa *isa = isa_named(name);
    return usable(isa) ? kernels_of(isa) : NULL;
}

static const attnx_isa *best_isa(void)
{
    const attnx_isa *isa = isa_named(getenv("ATTNX_ISA"));
    if (usable(isa)) return isa;
    for (int i = attnx_isa_total - 1; i > 0; i--)
        if (usable(&attnx_isas[i])) return &attnx_isas[i];
    return &attnx_isas[0];
}

/* Set by attnx_set_isa() or on first use. Every value ever stored is a valid
 * entry, so racing first uses are harmless; the pointer is atomic so that
 * they are not a data race. */
static _Atomic(const attnx_isa *) active = NULL;

static const attnx_isa *active_isa(void)
{
    const attnx_isa *isa = atomic_load(&active);
    if (!isa) atomic_store(&active, isa = best_isa());
    return isa;
}

const attnx_kernels *attnx_active_kernels(void) { return kernels_of(active_isa()); }

int attnx_bf16_dots(void) { return attnx_active_kernels()->qk_bf16 != NULL; }

const char *attnx_isa_name(void) { return active_isa()->name; }

int attnx_isa_available(const char *name) { return attnx_isa_kernels(name) != NULL; }

int attnx_isa_count(void) { return attnx_isa_total; }

const char *attnx_isa_name_at(int i)
{
    return i >= 0 && i < attnx_isa_total ? attnx_isas[i].name : NULL;
}

attnx_status attnx_set_isa(const char *name)
{
    const attnx_isa *isa = isa_named(name);
    if (!usable(isa)) return ATTNX_ERR_ISA;
    atomic_store(&active, isa);
    return ATTNX_OK;
}
