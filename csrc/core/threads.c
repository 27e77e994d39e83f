/* A small persistent pool of POSIX threads that run one parallel section at
 * a time: attnx_parallel(n, fn, arg) runs fn(arg, 0) on the caller and
 * fn(arg, t) for t = 1 .. n-1 on workers, and returns when all are done.
 *
 * Why a pool: creating a thread for every call, and waking an idle vCPU for
 * it, costs tens of microseconds each, as much as a whole small problem. Workers
 * spin for a short while after each section (ATTNX_SPIN_US, default 100 us)
 * so that back-to-back calls find them awake, then sleep on a condition
 * variable.
 *
 * fork(): a child has none of the parent's workers. pthread_atfork handlers,
 * registered when the module loads (attnx_threads_init), hold the pool's lock
 * across fork() and reset the pool in the child, which then starts workers of
 * its own on its first parallel call. A child never runs a section on an
 * OpenMP team: libgomp's team did not come along either, and a child that
 * joins it waits for it forever.
 *
 * Several Python threads may call at once (the GIL is released): one owns the
 * pool for its section, the others run their section alone on their own
 * thread, which is always correct since the threads of a call take its items
 * from a shared counter (attnx_parallel_items).
 *
 * Another library's OpenMP threads: after attnx_use_openmp(1), the calls a
 * thread makes between attnx_on_team(1) and attnx_on_team(0) (attnx.torch's
 * calls, in place of torch's own ops) run their sections on the team of an
 * OpenMP runtime already loaded in the process (libgomp's GOMP_parallel, as
 * torch's own libgomp.so.1 exports it) instead of the pool. Other calls
 * (NumPy's) never start that team's threads: a process whose team never ran
 * forks children in which the team still works (libgomp's does not survive a
 * fork once its threads exist).
 * After each of its ops, torch's OpenMP workers spin for milliseconds
 * (libgomp's GOMP_SPINCOUNT, 300000 pauses): the pool's workers woken beside
 * them share the cores with spinning threads. On their own team the spinning
 * worker takes attnx's section at once.
 *
 * The default thread count comes from ATTNX_NUM_THREADS, else
 * OMP_NUM_THREADS, else the CPUs this process may run on. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/platform.h"

#define MAX_THREADS ATTNX_MAX_THREADS

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;     /* workers: a new section is posted */
    pthread_cond_t done;     /* the owner: the last worker has finished */
    int started;             /* workers alive, tids 1 .. started */
    unsigned long gen;       /* section number, under mu */
    atomic_ulong agen;       /* the same, for spinning readers */
    void (*fn)(void *, int); /* the section, under mu */
    void *arg;
    int n;              /* its participants, owner included */
    atomic_int pending; /* workers of the section yet to finish */
    atomic_int busy;    /* 1 while a caller owns the pool */
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER,
          .done = PTHREAD_COND_INITIALIZER};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static long long spin_ns = 100000;

/* A loaded OpenMP runtime's entry points, looked for (under omp.mu) until
 * found, then kept; omp_on: the sections run on it. */
static struct {
    pthread_mutex_t mu;
    void (*parallel)(void (*fn)(void *), void *data, unsigned nthreads, unsigned flags);
    int (*thread_num)(void);
    char name[512]; /* its file */
} omp = {.mu = PTHREAD_MUTEX_INITIALIZER};
static atomic_int omp_on;
/* 1 in a fork() child of a process that had attnx loaded: no OpenMP team here */
static atomic_int forked;
/* 1 while this thread's calls may run on the team (attnx_on_team) */
static _Thread_local int on_team;

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static long long now_ns(void) { return attnx_os_now_ns(); }

/* Spin until the section number differs from old, for at most spin_ns: 1 if it did. */
static int spin_until_gen_changes(unsigned long old)
{
    const long long t0 = now_ns();
    for (int i = 1;; i++) {
        if (atomic_load_explicit(&pool.agen, memory_order_acquire) != old) return 1;
        cpu_relax();
        if ((i & 63) == 0 && now_ns() - t0 > spin_ns) return 0;
    }
}

/* The section number when worker t was created: its first section is the next one. */
static unsigned long start_gen[MAX_THREADS];

static void *worker_main(void *x)
{
    const int tid = (int)(intptr_t)x;
    pthread_mutex_lock(&pool.mu);
    unsigned long seen = start_gen[tid];
    pthread_mutex_unlock(&pool.mu);
    for (;;) {
        spin_until_gen_changes(seen);
        pthread_mutex_lock(&pool.mu);
        while (pool.gen == seen) pthread_cond_wait(&pool.wake, &pool.mu);
        seen = pool.gen; /* read the section with its number */
        void (*fn)(void *, int) = pool.fn;
        void *arg = pool.arg;
        const int take = tid < pool.n;
        pthread_mutex_unlock(&pool.mu);
        if (!take) continue;
        fn(arg, tid);
        if (atomic_fetch_sub(&pool.pending, 1) == 1) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
    return NULL;
}

static void before_fork(void)
{
    pthread_mutex_lock(&omp.mu);
    pthread_mutex_lock(&pool.mu);
}
static void after_fork_parent(void)
{
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&omp.mu);
}
static void after_fork_child(void)
{
    /* the workers did not come along: start afresh, on the pool (libgomp's
     * team did not come along either, and it waits for it) */
    atomic_store(&omp_on, 0);
    atomic_store(&forked, 1);
    pthread_mutex_init(&omp.mu, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.started = 0;
    atomic_store(&pool.pending, 0);
    atomic_store(&pool.busy, 0);
}

static void pool_init(void)
{
    const char *s = getenv("ATTNX_SPIN_US");
    if (s && *s) {
        char *end;
        const long us = strtol(s, &end, 10);
        if (*end == '\0' && us >= 0 && us <= 1000000) spin_ns = us * 1000;
    }
    (void)attnx_os_at_fork(before_fork, after_fork_parent, after_fork_child); /* none on Windows */
}

void attnx_threads_init(void) { pthread_once(&pool_once, pool_init); }

/* Start workers until there are n - 1 (under mu); fewer if a thread cannot
 * be created: the counter of items shares the work among those there are. */
static void grow_pool(int n)
{
    while (pool.started < n - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        start_gen[pool.started + 1] = pool.gen;
        const int ok =
            pthread_create(&th, &attr, worker_main, (void *)(intptr_t)(pool.started + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        pool.started++;
    }
}

/* Post the section fn(arg, tid) for tids 1 .. n-1 (under mu). */
static void post_section(int n, void (*fn)(void *arg, int tid), void *arg)
{
    const int helpers = n - 1 < pool.started ? n - 1 : pool.started;
    pool.fn = fn;
    pool.arg = arg;
    pool.n = helpers + 1;
    atomic_store(&pool.pending, helpers);
    pool.gen++;
    atomic_store_explicit(&pool.agen, pool.gen, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
}

/* Spin for the helpers to finish, then sleep until they do. */
static void wait_for_helpers(void)
{
    const long long t0 = now_ns();
    for (int i = 1; atomic_load(&pool.pending) > 0; i++) {
        cpu_relax();
        if ((i & 63) == 0 && now_ns() - t0 > spin_ns) {
            pthread_mutex_lock(&pool.mu);
            while (atomic_load(&pool.pending) > 0) pthread_cond_wait(&pool.done, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
            return;
        }
    }
}

/* The first loaded OpenMP runtime (libgomp: GNU's; libiomp: Intel's, which
 * exports the same GOMP_ entry points) whose path starts with under (a
 * directory; "" for any), into omp (under omp.mu); where it cannot be found
 * (Windows), the sections stay on the pool. */
static void find_openmp(const char *under)
{
    void *par, *num;
    if (!attnx_os_find_openmp(under, &par, &num, omp.name, sizeof omp.name)) return;
    /* object to function pointer: POSIX's dlsym guarantees it */
    memcpy(&omp.parallel, &par, sizeof par);
    memcpy(&omp.thread_num, &num, sizeof num);
}

const char *attnx_use_openmp(int on, const char *under)
{
    pthread_once(&pool_once, pool_init); /* its fork handlers */
    pthread_mutex_lock(&omp.mu);
    if (on && !omp.parallel && under) find_openmp(under);
    if (on && !omp.parallel) find_openmp("");
    const int use = on && omp.parallel != NULL && !atomic_load(&forked);
    atomic_store(&omp_on, use);
    pthread_mutex_unlock(&omp.mu);
    return use ? omp.name : NULL;
}

int attnx_on_team(int on)
{
    const int was = on_team;
    on_team = on != 0;
    return was;
}

typedef struct {
    void (*fn)(void *, int);
    void *arg;
} omp_section;

static void omp_body(void *s_)
{
    const omp_section *s = s_;
    s->fn(s->arg, omp.thread_num());
}

void attnx_parallel(int n, void (*fn)(void *arg, int tid), void *arg)
{
    int expected = 0;
    if (n <= 1 || !atomic_compare_exchange_strong(&pool.busy, &expected, 1)) {
        fn(arg, 0); /* alone, or the pool is someone else's */
        return;
    }
    pthread_once(&pool_once, pool_init);
    if (n > MAX_THREADS) n = MAX_THREADS;
    if (on_team && atomic_load(&omp_on)) {
        /* a team of at most n threads, numbered 0 (this one) .. n-1 */
        omp_section s = {fn, arg};
        omp.parallel(omp_body, &s, (unsigned)n, 0);
        atomic_store(&pool.busy, 0);
        return;
    }
    pthread_mutex_lock(&pool.mu);
    grow_pool(n);
    post_section(n, fn, arg);
    pthread_mutex_unlock(&pool.mu);
    fn(arg, 0);
    wait_for_helpers();
    atomic_store(&pool.busy, 0);
}

/* The items of a call: the next one to take, shared by its threads. */
typedef struct {
    atomic_llong next;
    int64_t n_items;
    void (*item)(void *arg, int tid, int64_t i);
    void *arg;
} item_queue;

static void take_items(void *q_, int tid)
{
    item_queue *q = q_;
    for (;;) {
        const int64_t i = atomic_fetch_add(&q->next, 1);
        if (i >= q->n_items) break;
        q->item(q->arg, tid, i);
    }
}

void attnx_wait_for(atomic_llong *x, long long want)
{
    for (int spins = 0; atomic_load_explicit(x, memory_order_acquire) != want;) {
        if (spins < 1024) {
            cpu_relax();
            spins++;
        } else {
            attnx_os_yield(); /* more threads than cores: let the awaited one run */
        }
    }
}

void attnx_parallel_items(int nt, int64_t n_items, void (*item)(void *arg, int tid, int64_t i),
                          void *arg)
{
    item_queue q = {.n_items = n_items, .item = item, .arg = arg};
    atomic_init(&q.next, 0);
    attnx_parallel(nt, take_items, &q);
}

static atomic_int requested = 0; /* 0: the default */

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
    if (!n) n = attnx_os_cpu_count(); /* its affinity mask where the system has one */
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

static _Thread_local int last_threads;

int attnx_last_threads(void) { return last_threads; }

void attnx_note_threads(int n) { last_threads = n; }

int attnx_get_num_threads(void)
{
    const int n = atomic_load(&requested);
    return n > 0 ? n : default_threads();
}

void attnx_set_num_threads(int n)
{
    atomic_store(&requested, n > 0 ? (n > MAX_THREADS ? MAX_THREADS : n) : 0);
}
