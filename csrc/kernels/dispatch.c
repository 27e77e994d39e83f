/* The instruction sets: one table of name, support probe and kernels, from
 * which the kernels in use are picked once: the widest instruction set that
 * the CPU and the OS support, unless ATTNX_ISA=scalar|avx2|avx512|neon asks
 * for another (an unavailable request falls back to the best available one).
 * A new instruction set is one row here, one kernels/<isa>.c and one line in
 * csrc/sources.txt. An instruction set may have bfloat16 dot products on top
 * (AVX-512: AMX tiles, vdpbf16ps), picked the same way from ATTNX_BF16_DOTS. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "core/platform.h"
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

/* The test build whose AVX-512 kernels run on SIMDe (emulate_avx512.h) has
 * AVX-512 and AVX512_BF16 on any CPU with AVX2, and never real tiles. */
#ifdef ATTNX_EMULATE_AVX512
#define EMULATED(answer) return (answer)
#else
#define EMULATED(answer) (void)0
#endif

static int cpu_has_avx512(void)
{
    unsigned int a, b, c, d;
    if (!cpu_has_avx2()) return 0;
    EMULATED(1);
    /* the OS saves the opmask and ZMM state: XCR0, or where the OS grants it
     * on first use (macOS, which shows it off in XCR0 until then) its answer */
    const int granted = attnx_os_avx512_granted();
    if (granted == 0 || (granted < 0 && (xgetbv0() & 0xe6) != 0xe6)) return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int f = (b >> 16) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
    return f && bw && vl;
}

/* AVX512_BF16 (vdpbf16ps): CPUID.(EAX=7, ECX=1):EAX bit 5, on top of AVX-512. */
static int cpu_has_avx512_bf16(void)
{
    unsigned int a, b, c, d;
    if (!cpu_has_avx512()) return 0;
    EMULATED(1);
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || a < 1) return 0; /* no leaf 7.1 */
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
    return (a >> 5) & 1;
}

/* AMX-BF16 and AMX-TILE (CPUID.(EAX=7, ECX=0):EDX bits 22 and 24), the OS
 * saving the tile state (XCR0 bits 17-18), and on Linux the process granted
 * that state (arch_prctl ARCH_REQ_XCOMP_PERM: a tile instruction without it
 * is SIGILL; Linux refuses it while a thread's signal stack is too small for
 * the 8 KiB of tiles, and then this says no). amx.c leaves D % 32 and the
 * last keys to vdpbf16ps, so AVX512_BF16 is required too. Other systems: no. */
static int cpu_has_amx_bf16(void)
{
    unsigned int a, b, c, d;
    if (!cpu_has_avx512_bf16()) return 0;
    EMULATED(0);
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return 0;
    if ((xgetbv0() & 0x60000) != 0x60000) return 0;
    return attnx_os_request_amx();
}
#elif defined(ATTNX_HAVE_X86)
static int cpu_has_avx2(void) { return 0; } /* no cpuid.h: stay on the scalar path */
static int cpu_has_avx512(void) { return 0; }
static int cpu_has_avx512_bf16(void) { return 0; }
static int cpu_has_amx_bf16(void) { return 0; }
#endif

static int always(void) { return 1; }

#ifdef ATTNX_HAVE_X86
/* AVX-512's bfloat16 dot products, best first. */
static const attnx_dots avx512_dots[] = {
    {.name = "amx",
     .supported = cpu_has_amx_bf16,
     .kernels = &attnx_kernels_avx512_amx,
     .same_bits = 0},
    {.name = "avx512_bf16",
     .supported = cpu_has_avx512_bf16,
     .kernels = &attnx_kernels_avx512_bf16,
     .same_bits = 1},
    /* amx.c on the tile unit's model (tile_model.h): for tests, when asked */
    {.name = "amx_emulated",
     .supported = cpu_has_avx512_bf16,
     .kernels = &attnx_kernels_avx512_amx_emulated,
     .same_bits = 0,
     .asked_only = 1},
    {.name = NULL, .supported = NULL, .kernels = NULL, .same_bits = 0},
};
#endif

/* Every instruction set the core knows, narrowest first: the default is the
 * last one available. NEON is part of the aarch64 baseline. */
const attnx_isa attnx_isas[] = {
    {.name = "scalar", .supported = always, .kernels = &attnx_kernels_scalar},
#ifdef ATTNX_HAVE_X86
    {.name = "avx2", .supported = cpu_has_avx2, .kernels = &attnx_kernels_avx2},
    {.name = "avx512",
     .supported = cpu_has_avx512,
     .kernels = &attnx_kernels_avx512,
     .dots = avx512_dots},
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

/* Each row's bfloat16 dot products, picked once (cpuid may trap to a
 * hypervisor: too slow for every call): 0 not yet, else 1 + the index of the
 * row of dots in use, or 1 + the index of its NULL row for none. The one
 * ATTNX_BF16_DOTS names if the CPU has it (or "none"), else the best. */
static _Atomic int dots_picked[sizeof attnx_isas / sizeof *attnx_isas];

static int pick_dots(const attnx_dots *dots)
{
    const char *want = getenv("ATTNX_BF16_DOTS");
    int n = 0, best = -1;
    for (; dots[n].name; n++) {
        if (!dots[n].supported()) continue;
        if (want && strcmp(want, dots[n].name) == 0) return n;
        if (best < 0 && !dots[n].asked_only) best = n;
    }
    if (want && strcmp(want, "none") == 0) return n;
    return best < 0 ? n : best;
}

/* The row of bfloat16 dot products in use with a usable instruction set, or
 * NULL. */
static const attnx_dots *dots_of(const attnx_isa *isa)
{
    if (!isa->dots) return NULL;
    _Atomic int *picked = &dots_picked[isa - attnx_isas];
    int at = atomic_load(picked);
    if (!at) atomic_store(picked, at = 1 + pick_dots(isa->dots));
    const attnx_dots *dots = &isa->dots[at - 1];
    return dots->name ? dots : NULL;
}

/* The kernels of a usable instruction set: its table with qk_bf16 when the
 * CPU has bfloat16 dot products. */
static const attnx_kernels *kernels_of(const attnx_isa *isa)
{
    const attnx_dots *dots = dots_of(isa);
    return dots ? dots->kernels : isa->kernels;
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

const char *attnx_bf16_dots(void)
{
    const attnx_dots *dots = dots_of(active_isa());
    return dots ? dots->name : NULL;
}

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
