/* The platform layer: everything the core asks of the operating system,
 * answered in one file (platform.c) for Linux, macOS and Windows, so that no
 * other source holds an operating system's #if. Threads themselves are POSIX
 * threads everywhere (MinGW-w64's winpthreads on Windows).
 *
 *   what                          Linux            macOS             Windows (MinGW-w64)
 *   CPUs this process may use     sched_getaffinity sysconf          GetActiveProcessorCount
 *   64-byte aligned memory        aligned_alloc    aligned_alloc     _aligned_malloc
 *   fork() handlers               pthread_atfork   pthread_atfork    none (no fork)
 *   a loaded OpenMP runtime       dl_iterate_phdr  dyld's images     none: the pool's threads
 *   AVX-512 state (x86-64)        XCR0             hw.optional.avx512f (granted on first use)
 *   AMX tile state                arch_prctl       none              none
 *   a monotonic clock             clock_gettime    clock_gettime     QueryPerformanceCounter */
#ifndef ATTNX_PLATFORM_H
#define ATTNX_PLATFORM_H

#include <stddef.h>

/* The CPUs this process may run on (its affinity mask where the system has
 * one), at least 1. */
int attnx_os_cpu_count(void);

/* n bytes aligned to 64, or NULL; freed by attnx_os_aligned_free (only). */
void *attnx_os_aligned_alloc(size_t n);
void attnx_os_aligned_free(void *p);

/* Register fork() handlers (pthread_atfork); 0 where processes do not fork. */
int attnx_os_at_fork(void (*before)(void), void (*parent)(void), void (*child)(void));

/* A loaded OpenMP runtime whose file name starts with libgomp or libiomp and
 * whose path starts with `under` ("" for any): its GOMP_parallel and
 * omp_get_thread_num into *parallel and *thread_num, its path into name (n
 * bytes); 1 if found, 0 if not (or where it cannot be looked for). */
int attnx_os_find_openmp(const char *under, void **parallel, void **thread_num, char *name,
                         size_t n);

/* 1 or 0 where the OS says whether it grants the AVX-512 state (macOS: on
 * first use, so XCR0 shows it off until then); -1 where XCR0 tells. */
int attnx_os_avx512_granted(void);

/* Ask for the AMX tile state (Linux: arch_prctl); 1 if granted. */
int attnx_os_request_amx(void);

/* Nanoseconds of a monotonic clock. */
long long attnx_os_now_ns(void);

/* Let another thread run (more threads than cores). */
void attnx_os_yield(void);

#endif
