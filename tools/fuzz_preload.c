/* LD_PRELOADed by tools/fuzz.sh, before gcc's libasan.so.
 *
 * The extension is built with gcc's AddressSanitizer, whose runtime (which
 * must be preloaded into the uninstrumented Python) also defines the
 * SanitizerCoverage hooks below, as no-op weak functions. Atheris' prebuilt
 * wheel carries its own libFuzzer, and its Python coverage (counters, cmp
 * tracing) goes through these very hooks: resolved to libasan's no-ops, the
 * fuzzer would be blind (atheris warns "Coverage symbols are being provided
 * by a library other than libFuzzer"). Preloaded first, this library
 * defines them and forwards each call to the libFuzzer inside atheris
 * (path in ATTNX_FUZZ_LIBFUZZER), by a tail call so that the caller's return
 * address, which libFuzzer uses to tell comparison sites apart, is kept.
 * atheris still prints its warning (it sees this file as the provider); the
 * "cov:" and "NEW" lines of the fuzzer show that coverage works.
 *
 * Every hook takes at most six integer or pointer arguments, passed on
 * unchanged in registers (x86-64 and aarch64 calling conventions).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>

typedef uintptr_t (*fn6)(uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t, uintptr_t);

static fn6 resolve(const char *name)
{
    const char *path = getenv("ATTNX_FUZZ_LIBFUZZER");
    void *h = path ? dlopen(path, RTLD_LAZY | RTLD_NOLOAD) : NULL;   /* only once atheris loaded it */
    return h ? (fn6)dlsym(h, name) : NULL;
}

#define FORWARD(name)                                                                   \
    static fn6 p_##name;                                                                \
    __attribute__((visibility("default"))) uintptr_t name(uintptr_t a, uintptr_t b,    \
                                                          uintptr_t c, uintptr_t d,    \
                                                          uintptr_t e, uintptr_t f)    \
    {                                                                                   \
        fn6 t = __atomic_load_n(&p_##name, __ATOMIC_RELAXED);                          \
        if (!t) {                                                                       \
            if (!(t = resolve(#name))) return 0;                                        \
            __atomic_store_n(&p_##name, t, __ATOMIC_RELAXED);                          \
        }                                                                               \
        return t(a, b, c, d, e, f);                                                     \
    }

/* the hooks that both libasan and atheris' libFuzzer define */
FORWARD(__sanitizer_cov_8bit_counters_init)
FORWARD(__sanitizer_cov_pcs_init)
FORWARD(__sanitizer_cov_trace_cmp1)
FORWARD(__sanitizer_cov_trace_cmp2)
FORWARD(__sanitizer_cov_trace_cmp4)
FORWARD(__sanitizer_cov_trace_cmp8)
FORWARD(__sanitizer_cov_trace_const_cmp1)
FORWARD(__sanitizer_cov_trace_const_cmp2)
FORWARD(__sanitizer_cov_trace_const_cmp4)
FORWARD(__sanitizer_cov_trace_const_cmp8)
FORWARD(__sanitizer_cov_trace_div4)
FORWARD(__sanitizer_cov_trace_div8)
FORWARD(__sanitizer_cov_trace_gep)
FORWARD(__sanitizer_cov_trace_pc_guard)
FORWARD(__sanitizer_cov_trace_pc_guard_init)
FORWARD(__sanitizer_cov_trace_pc_indir)
FORWARD(__sanitizer_cov_trace_switch)
FORWARD(__sanitizer_weak_hook_memcmp)
FORWARD(__sanitizer_weak_hook_memmem)
FORWARD(__sanitizer_weak_hook_strcasecmp)
FORWARD(__sanitizer_weak_hook_strcasestr)
FORWARD(__sanitizer_weak_hook_strcmp)
FORWARD(__sanitizer_weak_hook_strncasecmp)
FORWARD(__sanitizer_weak_hook_strncmp)
FORWARD(__sanitizer_weak_hook_strstr)
