/* Threads for one call: the caller runs tid 0 and n-1 POSIX threads run the
 * rest; all are joined before returning. Nothing outlives a call, so there is
 * no pool to break in a child after fork() (libgomp's pool can hang there).
 *
 * The default count comes from ATTNX_NUM_THREADS, else OMP_NUM_THREADS, else
 * the CPUs this process may run on. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "attnx.h"
#include "threads.h"

#define MAX_THREADS 256

typedef struct {
    void (*fn)(void *, int);
    void *arg;
    int tid;
} start;

static void *trampoline(void *x)
{
    start *s = x;
    s->fn(s->arg, s->tid);
    return NULL;
}

void attnx_parallel(int n, void (*fn)(void *arg, int tid), void *arg)
{
    if (n <= 1) { fn(arg, 0); return; }
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_t th[MAX_THREADS];
    start st[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 1; t < n; t++) {
        st[t].fn = fn; st[t].arg = arg; st[t].tid = t;
        /* a thread that cannot start leaves its share to the others: the
         * workers take items from a shared counter until none are left */
        started[t] = pthread_create(&th[t], NULL, trampoline, &st[t]) == 0;
    }
    fn(arg, 0);
    for (int t = 1; t < n; t++)
        if (started[t]) pthread_join(th[t], NULL);
}

static atomic_int requested = 0;   /* 0: the default */

static int env_int(const char *name)
{
    const char *s = getenv(name);
    if (!s || !*s) return 0;
    char *end;
    long v = strtol(s, &end, 10);
    return (*end == '\0' && v > 0 && v <= MAX_THREADS) ? (int)v : 0;
}

static int count_default_threads(void)
{
    int n = env_int("ATTNX_NUM_THREADS");
    if (!n) n = env_int("OMP_NUM_THREADS");
#ifdef CPU_COUNT
    if (!n) {
        cpu_set_t set;
        if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
    }
#endif
    if (!n) n = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    return n > MAX_THREADS ? MAX_THREADS : n;
}

/* Read once: the environment and the affinity mask are the process's at
 * first use (as OpenMP reads OMP_NUM_THREADS once). */
static atomic_int default_count = 0;

static int default_threads(void)
{
    int n = atomic_load(&default_count);
    if (n == 0) atomic_store(&default_count, n = count_default_threads());
    return n;
}

int attnx_get_num_threads(void)
{
    const int n = atomic_load(&requested);
    return n > 0 ? n : default_threads();
}

void attnx_set_num_threads(int n)
{
    atomic_store(&requested, n > 0 ? (n > MAX_THREADS ? MAX_THREADS : n) : 0);
}
