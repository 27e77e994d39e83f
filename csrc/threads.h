/* Internal: run fn(arg, tid) for tid = 0 .. n-1 concurrently and wait. */
#ifndef ATTNX_THREADS_H
#define ATTNX_THREADS_H

void attnx_parallel(int n, void (*fn)(void *arg, int tid), void *arg);

#endif
