/* Phased runs: a chain of dependent steps in one parallel call (threads.c).
 * DecoderLayer's steps (norms, quantized rows, GEMM panels, attention tasks) are one list of items
 * in phases. Items are claimed in order from one counter, and an item starts once every item of
 * the phases before its own is done. A thread only ever waits for items already claimed, whose
 * threads are running them, so the run cannot deadlock however many of ORT's threads join it (one
 * thread alone runs every item in order). What it saves is one ORT node and one ParallelFor per
 * step (docs/attention_cpu.md, "One node per layer"). */
#ifndef LLMC_THREADS_H
#define LLMC_THREADS_H

#include <stdatomic.h>
#include <stdint.h>

#include "ort_abi.h"

#define MAX_PHASES 16
#define MAX_WORKERS 64

typedef struct {
    void (*run)(void *arg, int64_t item);
    void *arg;
    int64_t items, chunk; /* items per claim */
    int64_t end;          /* claims of this phase and every one before it */
} phase;

/* The counters live on cache lines of their own: every claim writes `next`, and a line shared
 * with what the waiting threads read would travel between the cores on every item. A thread
 * publishes how many items it has finished only as it moves to a later phase (or runs out),
 * which is when another thread can be waiting for them. */
typedef struct {
    _Alignas(64) _Atomic int64_t value;
} padded_counter;

typedef struct {
    phase phases[MAX_PHASES];
    int count;
    uint64_t seq; /* which run this is, for the threads' marks */
    padded_counter next, joined;
    padded_counter finished[MAX_WORKERS];
} phased_run;

/* A phase of `items`, claimed `chunk` at a time: a run of consecutive panels streams as one. */
void add_phase(phased_run *r, void (*run)(void *, int64_t), void *arg, int64_t items, int64_t chunk);

/* The threads a node's run can expect: as many as its last run had (`*threads`, kept per node:
 * a draft engine's one-thread session and its target's take turns in one process), at first one
 * per CPU. */
int64_t run_width(_Atomic int64_t *threads);

/* Runs r's items on ORT's intra-op threads, each joining once, then records in *threads how many
 * joined. */
OrtStatus *run_phases(OrtKernelContext *ctx, phased_run *r, _Atomic int64_t *threads);

#endif
