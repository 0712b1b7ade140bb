/* The scheduler of DecoderLayer's phased runs (threads.h): threads of ORT's intra-op pool claim
 * the run's items in order and wait only for the phases before their item's own. */
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#include "kernels.h"
#include "ort_glue.h"
#include "threads.h"

/* ORT calls phased_worker once per CPU (it cannot say how many threads its pool has); a thread
 * joins a run once, marked by the run's number. */
static _Atomic uint64_t run_seq;
static _Thread_local uint64_t joined_run;

void add_phase(phased_run *r, void (*run)(void *, int64_t), void *arg, int64_t items, int64_t chunk) {
    if (items <= 0)
        return;
    chunk = chunk < 1 ? 1 : chunk;
    int64_t before = r->count ? r->phases[r->count - 1].end : 0;
    r->phases[r->count++] = (phase){.run = run, .arg = arg, .items = items, .chunk = chunk,
                                    .end = before + (items + chunk - 1) / chunk};
}

static inline void spin_wait(unsigned spins) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if (spins % 4096 == 4095)  /* the thread we wait for lost its core: give ours up */
        sched_yield();
}

/* Items finished by every thread that has joined, as published. */
static int64_t finished_items(phased_run *r) {
    int64_t joined = atomic_load_explicit(&r->joined.value, memory_order_acquire), sum = 0;
    for (int64_t t = 0; t < joined && t < MAX_WORKERS; t++)
        sum += atomic_load_explicit(&r->finished[t].value, memory_order_acquire);
    return sum;
}

static void phased_worker(void *arg, size_t unused) {
    (void)unused;
    phased_run *r = arg;
    if (joined_run == r->seq)
        return;  /* this thread ran out of items already */
    joined_run = r->seq;
    int64_t me = atomic_fetch_add_explicit(&r->joined.value, 1, memory_order_acq_rel);
    if (me >= MAX_WORKERS)
        return;  /* the others run every item */
    int64_t total = r->count ? r->phases[r->count - 1].end : 0, done = 0;
    int p = 0;
    for (;;) {
        int64_t item = atomic_fetch_add_explicit(&r->next.value, 1, memory_order_relaxed);
        if (item >= total || item >= r->phases[p].end) {  /* leaving a phase: say what this thread did */
            atomic_store_explicit(&r->finished[me].value, done, memory_order_release);
            if (item >= total)
                return;
            while (item >= r->phases[p].end)
                p++;
        }
        int64_t first = p ? r->phases[p - 1].end : 0;
        for (unsigned spins = 0; finished_items(r) < first; spins++)
            spin_wait(spins);
        const phase *ph = &r->phases[p];
        int64_t i0 = (item - first) * ph->chunk, i1 = i0 + ph->chunk < ph->items ? i0 + ph->chunk : ph->items;
        for (int64_t i = i0; i < i1; i++)
            ph->run(ph->arg, i);
        done++;
    }
}

/* The most threads a run can have: ORT's pool is at most one per CPU. */
static int64_t workers(void) { return llmc_cpus() < MAX_WORKERS ? llmc_cpus() : MAX_WORKERS; }

int64_t run_width(_Atomic int64_t *threads) {
    int64_t last = atomic_load_explicit(threads, memory_order_relaxed);
    return last > 0 ? last : workers();
}

OrtStatus *run_phases(OrtKernelContext *ctx, phased_run *r, _Atomic int64_t *threads) {
    r->seq = atomic_fetch_add_explicit(&run_seq, 1, memory_order_relaxed) + 1;
    OrtStatus *status = parallel(ctx, phased_worker, (size_t)workers(), r);
    int64_t joined = atomic_load_explicit(&r->joined.value, memory_order_relaxed);
    atomic_store_explicit(threads, joined < MAX_WORKERS ? joined : MAX_WORKERS, memory_order_relaxed);
    return status;
}
