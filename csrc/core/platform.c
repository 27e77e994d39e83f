/* The platform layer (platform.h): the one home of the core's operating
 * system code, Linux, macOS and Windows (MinGW-w64) side by side. */
#if defined(__linux__)
#define _GNU_SOURCE /* sched_getaffinity, dl_iterate_phdr, syscall under -std=c11 */
#elif defined(__APPLE__)
#define _DARWIN_C_SOURCE /* sysctlbyname, the dyld functions under -std=c11 */
#endif
#include "core/platform.h"

#include <stdlib.h>
#include <string.h>

#if defined(_WIN32)
#include <malloc.h>
#include <windows.h>
#else
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#endif
#if defined(__linux__)
#include <link.h>
#include <sys/syscall.h>
#elif defined(__APPLE__)
#include <mach-o/dyld.h>
#include <sys/sysctl.h>
#endif

int attnx_os_cpu_count(void)
{
    long n = 0;
#if defined(_WIN32)
    n = (long)GetActiveProcessorCount(ALL_PROCESSOR_GROUPS);
#else
#if defined(__linux__) && defined(CPU_COUNT)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
#endif
    if (n < 1) n = sysconf(_SC_NPROCESSORS_ONLN);
#endif
    return n < 1 ? 1 : n > 1 << 20 ? 1 << 20 : (int)n;
}

void *attnx_os_aligned_alloc(size_t n)
{
    if (n > (size_t)-1 - 64) return NULL;
    n = (n + 63) & ~(size_t)63; /* aligned_alloc wants a multiple of 64 */
#if defined(_WIN32)
    return _aligned_malloc(n ? n : 64, 64);
#else
    return aligned_alloc(64, n ? n : 64);
#endif
}

void attnx_os_aligned_free(void *p)
{
#if defined(_WIN32)
    _aligned_free(p);
#else
    free(p);
#endif
}

int attnx_os_at_fork(void (*before)(void), void (*parent)(void), void (*child)(void))
{
#if defined(_WIN32)
    (void)before, (void)parent, (void)child;
    return 0;
#else
    return pthread_atfork(before, parent, child) == 0;
#endif
}

#if !defined(_WIN32)
/* A runtime's file, if its name and path qualify: its entry points (dlsym on
 * a handle of the library already loaded, never closed). */
static int take_openmp(const char *path, const char *under, void **parallel, void **thread_num,
                       char *name, size_t n)
{
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if (strncmp(path, under, strlen(under)) != 0) return 0;
    if (strncmp(base, "libgomp", 7) != 0 && strncmp(base, "libiomp", 7) != 0) return 0;
    if (strlen(path) >= n) return 0;
    void *h = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return 0;
    void *par = dlsym(h, "GOMP_parallel"), *num = dlsym(h, "omp_get_thread_num");
    if (!par || !num) return 0;
    *parallel = par;
    *thread_num = num;
    strcpy(name, path);
    return 1;
}
#endif

#if defined(__linux__)
typedef struct {
    const char *under;
    void **parallel, **thread_num;
    char *name;
    size_t n;
} openmp_query;

static int each_library(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    openmp_query *q = data;
    return take_openmp(info->dlpi_name, q->under, q->parallel, q->thread_num, q->name, q->n);
}
#endif

int attnx_os_find_openmp(const char *under, void **parallel, void **thread_num, char *name,
                         size_t n)
{
#if defined(__linux__)
    openmp_query q = {under, parallel, thread_num, name, n};
    return dl_iterate_phdr(each_library, &q) == 1;
#elif defined(__APPLE__)
    for (uint32_t i = 0, count = _dyld_image_count(); i < count; i++) {
        const char *path = _dyld_get_image_name(i);
        if (path && take_openmp(path, under, parallel, thread_num, name, n)) return 1;
    }
    return 0;
#else
    (void)under, (void)parallel, (void)thread_num, (void)name, (void)n;
    return 0;
#endif
}

int attnx_os_avx512_granted(void)
{
#if defined(__APPLE__) && defined(__x86_64__)
    int on = 0;
    size_t size = sizeof on;
    if (sysctlbyname("hw.optional.avx512f", &on, &size, NULL, 0) != 0) return 0;
    return on != 0;
#else
    return -1;
#endif
}

int attnx_os_request_amx(void)
{
#if defined(__linux__) && defined(__x86_64__)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    return 0;
#endif
}

long long attnx_os_now_ns(void)
{
#if defined(_WIN32)
    static LARGE_INTEGER freq;
    LARGE_INTEGER t;
    if (!freq.QuadPart) QueryPerformanceFrequency(&freq);
    QueryPerformanceCounter(&t);
    return (long long)((double)t.QuadPart * 1e9 / (double)freq.QuadPart);
#else
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
#endif
}

void attnx_os_yield(void)
{
#if defined(_WIN32)
    SwitchToThread();
#else
    sched_yield();
#endif
}
