/* Static work split with stealing at the end, for the OpenMP loops of the CPU kernels.
 *
 * Each thread owns a contiguous run of items and takes them from the front, in the order a
 * static split would, so whatever a thread keeps in its cache across items stays its own. A
 * thread whose run is empty takes items from the back of the others' runs. Why: the worker
 * shares its cores with the scheduler, the client and the OS; with a plain static split, a
 * thread preempted for a millisecond holds up the whole op at its closing barrier while the
 * other thread waits idle. With stealing, the other thread finishes the preempted one's items.
 *
 * A run is one 64-bit word, (next << 32) | end, changed only by compare-and-swap: the owner
 * moves next up, a thief moves end down, and one item is never taken twice. One word per cache
 * line, so an owner's takes touch no line another thread writes until somebody steals. */
#ifndef SPLITSERVE_WORK_RUNS_H
#define SPLITSERVE_WORK_RUNS_H
#include <stdint.h>

#define WORK_RUNS_MAX_THREADS 256

typedef struct {
    uint64_t range;
    char pad[56];
} WorkRun __attribute__((aligned(64)));

static inline void work_run_init(WorkRun *run, int64_t first, int64_t last) {
    __atomic_store_n(&run->range, ((uint64_t)first << 32) | (uint64_t)last, __ATOMIC_RELAXED);
}

/* the next item from the front of the run, or -1 when it is empty */
static inline int64_t work_run_take_front(WorkRun *run) {
    uint64_t v = __atomic_load_n(&run->range, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t next = v >> 32, end = v & 0xFFFFFFFFu;
        if (next >= end) return -1;
        if (__atomic_compare_exchange_n(&run->range, &v, ((next + 1) << 32) | end, 0,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return (int64_t)next;
    }
}

/* the last item of the run, or -1 when it is empty */
static inline int64_t work_run_take_back(WorkRun *run) {
    uint64_t v = __atomic_load_n(&run->range, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t next = v >> 32, end = v & 0xFFFFFFFFu;
        if (next >= end) return -1;
        if (__atomic_compare_exchange_n(&run->range, &v, (next << 32) | (end - 1), 0,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return (int64_t)(end - 1);
    }
}

/* Thread t's next item: its own run first, then the back of the others' (the next thread's
 * first). Sets *owner to the run the item came from; -1 when every run is empty. */
static inline int64_t work_runs_take(WorkRun *runs, int64_t threads, int64_t t, int64_t *owner) {
    int64_t item = work_run_take_front(&runs[t]);
    if (item >= 0) {
        *owner = t;
        return item;
    }
    for (int64_t k = 1; k < threads; k++) {
        const int64_t victim = (t + k) % threads;
        item = work_run_take_back(&runs[victim]);
        if (item >= 0) {
            *owner = victim;
            return item;
        }
    }
    return -1;
}
#endif
