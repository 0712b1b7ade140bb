/* DecoderLayer: a whole pre-norm decoder layer in one node.
 * SkipRMSNormMatMul (QKV) -> PagedAttention (packed QKV) -> PackedMatMul (O) -> SkipRMSNormMatMul
 * (gate/up) -> SwiGLUMatMul (down), the same kernels in the same order, so the outputs are those
 * of the five nodes bit for bit. Outputs: the down projection, the residual stream after the
 * attention (the next layer's skip and x), and the pool. The steps run as one phased run
 * (threads.h). */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "ops.h"
#include "ort_glue.h"
#include "threads.h"

#define LAYER_ROWS 8 /* rows per item of the row-wise steps (norms, SwiGLU, quantizing) */

typedef struct {
    linear_job linear[LINEARS];
    llmc_attention attention;
    const float *x, *skip, *gamma1, *gamma2, *qkv_bias;
    float epsilon1, epsilon2;
    int activation;
    float *sum1, *normed1, *normed2, *residual, *h;
    int64_t m, hidden;
    int out_of_memory;
} layer_job;

/* One scratch for the fused ops' intermediate rows, shared by every node of every session: a
 * session runs its nodes one at a time, so the layers of a step take turns with it and it stays
 * warm; a run that finds it taken (another session at the same time) allocates its own. */
static atomic_flag shared_busy = ATOMIC_FLAG_INIT;
static void *shared_scratch;
static size_t shared_bytes;

static void *layer_scratch(size_t bytes, int *own) {
    bytes = (bytes + 63) / 64 * 64;
    if (!atomic_flag_test_and_set_explicit(&shared_busy, memory_order_acquire)) {
        if (shared_bytes < bytes) {
            free(shared_scratch);
            shared_scratch = aligned_alloc(64, bytes);
            shared_bytes = shared_scratch != NULL ? bytes : 0;
        }
        if (shared_scratch != NULL) {
            *own = 0;
            return shared_scratch;
        }
        atomic_flag_clear_explicit(&shared_busy, memory_order_release);
    }
    *own = 1;
    return aligned_alloc(64, bytes);
}

static void layer_scratch_done(void *p, int own) {
    if (own)
        free(p);
    else
        atomic_flag_clear_explicit(&shared_busy, memory_order_release);
}

/* Quantize rows [r0, r1) of a linear's input, when its weight is quantized. */
static void layer_quantize(const linear_job *job, int64_t r0, int64_t r1) {
    if (llmc_format_bits(job->format))
        llmc_quantize_rows(&job->act, job->x, r0, r1);
}

static int64_t row_end(const layer_job *job, int64_t item) {
    int64_t end = (item + 1) * LAYER_ROWS;
    return end < job->m ? end : job->m;
}

static void layer_norm1(void *arg, int64_t item) {
    layer_job *job = arg;
    int64_t r0 = item * LAYER_ROWS, r1 = row_end(job, item);
    llmc_skip_rmsnorm_rows(job->x, job->skip, job->gamma1, job->sum1, job->normed1, job->hidden, job->epsilon1, r0, r1);
    layer_quantize(&job->linear[QKV], r0, r1);
}

static void layer_write(void *arg, int64_t item) {
    (void)item;
    llmc_attention_write(&((layer_job *)arg)->attention);
}

static void layer_attend(void *arg, int64_t item) { llmc_attention_task(&((layer_job *)arg)->attention, item); }

static void layer_combine(void *arg, int64_t item) {
    (void)item;
    layer_job *job = arg;
    if (!job->out_of_memory)
        llmc_attention_combine(&job->attention);
}

static void layer_quantize_o(void *arg, int64_t item) {
    layer_job *job = arg;
    layer_quantize(&job->linear[O], item * LAYER_ROWS, row_end(job, item));
}

static void layer_norm2(void *arg, int64_t item) {
    layer_job *job = arg;
    int64_t r0 = item * LAYER_ROWS, r1 = row_end(job, item);
    llmc_skip_rmsnorm_rows(job->sum1, job->linear[O].y, job->gamma2, job->residual, job->normed2, job->hidden,
                           job->epsilon2, r0, r1);
    layer_quantize(&job->linear[GATE_UP], r0, r1);
}

static void layer_swiglu(void *arg, int64_t item) {
    layer_job *job = arg;
    int64_t r0 = item * LAYER_ROWS, r1 = row_end(job, item);
    llmc_swiglu_rows(job->linear[GATE_UP].y, job->h, job->linear[DOWN].k, r0, r1, job->activation);
    layer_quantize(&job->linear[DOWN], r0, r1);
}

#define LAYER_PANELS(name, which) \
    static void name(void *arg, int64_t panel) { linear_panel(&((layer_job *)arg)->linear[which], panel); }
LAYER_PANELS(layer_o, O)
LAYER_PANELS(layer_gate_up, GATE_UP)
LAYER_PANELS(layer_down, DOWN)

/* The QKV panel, then its columns' bias (Qwen2's), added as the Add node after it did. */
static void layer_qkv(void *arg, int64_t panel) {
    layer_job *job = arg;
    const linear_job *l = &job->linear[QKV];
    linear_panel(l, panel);
    if (job->qkv_bias == NULL)
        return;
    int64_t c0 = panel * LLMC_PANEL, c1 = c0 + LLMC_PANEL < l->n ? c0 + LLMC_PANEL : l->n;
    for (int64_t r = 0; r < l->m; r++)
        for (int64_t c = c0; c < c1; c++)
            l->y[r * l->n + c] += job->qkv_bias[c];
}

/* `bytes` of the scratch at `base` (NULL: only count them), 64-byte aligned. */
static void *carve(char *base, size_t *used, size_t bytes) {
    char *at = base != NULL ? base + *used : NULL;
    *used += (bytes + 63) / 64 * 64;
    return at;
}

/* The rows between the steps, each quantized GEMM's quantized rows and the attention's partial
 * results, laid out in the scratch at `base` (the down projection writes the op's output);
 * returns the bytes they take. */
static size_t layer_parts(layer_job *job, char *base) {
    size_t used = 0, row = (size_t)job->m * sizeof(float);
    llmc_attention *a = &job->attention;
    linear_job *l = job->linear;
    job->sum1 = carve(base, &used, row * job->hidden);
    l[QKV].x = job->normed1 = carve(base, &used, row * job->hidden);
    l[QKV].y = carve(base, &used, row * l[QKV].n);
    l[O].x = a->out = carve(base, &used, row * l[O].k);
    l[O].y = carve(base, &used, row * l[O].n);
    l[GATE_UP].x = job->normed2 = carve(base, &used, row * job->hidden);
    l[GATE_UP].y = carve(base, &used, row * l[GATE_UP].n);
    l[DOWN].x = job->h = carve(base, &used, row * l[DOWN].k);
    a->partial = carve(base, &used, (size_t)llmc_attention_partial_floats(a) * sizeof(float));
    if (base != NULL)
        packed_qkv(a, l[QKV].y);
    for (int i = 0; i < LINEARS; i++) {
        if (!llmc_format_bits(l[i].format))
            continue;
        void *rows = carve(base, &used, (size_t)llmc_qact_bytes(job->m, l[i].k, l[i].act.block));
        if (base != NULL)
            llmc_qact_init(&l[i].act, rows, job->m, l[i].k, l[i].act.block);
    }
    return used;
}

/* A GEMM's panels as a phase, one claim per thread: each thread streams one contiguous run of
 * panels. Claims of a panel each, or of an eighth, took 1.1-2x the layer's time
 * (docs/attention_cpu.md, "One node per layer"). */
static void add_gemm(phased_run *r, void (*run)(void *, int64_t), void *arg, int64_t n, int64_t threads) {
    int64_t panels = panels_of(n);
    add_phase(r, run, arg, panels, (panels + threads - 1) / threads);
}

/* A stand-in for an intermediate tensor (the kernels' checks take tensors): float32 [B, S, width]. */
static tensor rows_tensor(const tensor *x, int64_t width) {
    tensor t = *x;
    t.value = NULL;
    t.dims[2] = width;
    return t;
}

OrtStatus *layer_compute(void *state, OrtKernelContext *ctx) {
    layer_kernel *kernel = state;
    const char *op = "DecoderLayer";
    tensor t[L_NUM_IN];
    TRY(inputs(ctx, t, L_NUM_IN));
    const tensor *x = &t[L_X];
    if (x->type != ORT_FLOAT || x->rank != 3)
        return error(op, "x must be float32 [batch, seq, hidden]");
    int64_t hidden = x->dims[2];
    const tensor *gammas[2] = {&t[L_GAMMA1], &t[L_GAMMA2]};
    if (t[L_SKIP].type != ORT_FLOAT || t[L_SKIP].rank != 3 || memcmp(t[L_SKIP].dims, x->dims, sizeof x->dims) != 0 ||
        gammas[0]->type != ORT_FLOAT || gammas[0]->rank != 1 || gammas[0]->dims[0] != hidden ||
        gammas[1]->type != ORT_FLOAT || gammas[1]->rank != 1 || gammas[1]->dims[0] != hidden)
        return error(op, "skip must match x's shape and both gammas be [hidden]");
    const linear_kernel *lk = kernel->linear;
    const tensor *bias = &t[L_QKV_BIAS];
    if (bias->value != NULL && (bias->type != ORT_FLOAT || bias->rank != 1 || bias->dims[0] != lk[QKV].n))
        return error(op, "qkv_bias must be float32 [qkv_n]");
    int64_t qkv_width = lk[QKV].n, inter = lk[GATE_UP].n / 2;
    if (lk[O].n != hidden || lk[DOWN].n != hidden || lk[GATE_UP].n % 2 != 0)
        return error(op, "O and down must project back to hidden, and gate/up to two equal halves");
    layer_job job = {.m = x->dims[0] * x->dims[1], .hidden = hidden, .activation = (int)lk[DOWN].activation,
                     .epsilon1 = lk[QKV].epsilon,
                     .epsilon2 = lk[GATE_UP].epsilon};

    tensor at[NUM_IN] = {0};
    at[IN_Q] = rows_tensor(x, qkv_width);
    at[IN_CACHE] = t[L_CACHE];
    at[IN_PAST] = t[L_PAST];
    at[IN_QLEN] = t[L_QLEN];
    at[IN_TABLES] = t[L_TABLES];
    at[IN_COS] = t[L_COS];
    at[IN_SIN] = t[L_SIN];
    at[IN_POS] = t[L_POS];
    at[IN_Q_NORM] = t[L_Q_NORM];
    at[IN_K_NORM] = t[L_K_NORM];
    llmc_attention *a = &job.attention;
    /* The query's data is set once the scratch exists: the checks read only its shape. */
    TRY(attention_setup(op, &kernel->attention, at, NULL, a));
    int64_t o_width = a->num_heads * a->head_dim;

    static const size_t weight_at[LINEARS] = {L_W_QKV, L_W_O, L_W_GATE_UP, L_W_DOWN};
    const int64_t in_width[LINEARS] = {hidden, o_width, hidden, inter};
    for (int i = 0; i < LINEARS; i++) {
        tensor in = rows_tensor(x, in_width[i]);
        int64_t k;
        TRY(check_packed(op, &lk[i], &in, &t[weight_at[i]], &k));
        job.linear[i] = (linear_job){.k = k, .n = lk[i].n, .m = job.m, .act.block = lk[i].block_size};
        TRY(weight_data(&lk[i], &t[weight_at[i]], &job.linear[i]));
        TRY(lossless_input(ctx, op, L_LOSSLESS + (size_t)i, &job.linear[i]));
    }

    float *y;
    TRY(output(ctx, 0, x->dims, 3, (void **)&y));
    TRY(output(ctx, 1, x->dims, 3, (void **)&job.residual));
    TRY(attention_pool(ctx, &t[L_CACHE], 2, a));
    if (job.m == 0)
        return NULL;

    TRY(data(x->value, (void **)&job.x));
    TRY(data(t[L_SKIP].value, (void **)&job.skip));
    TRY(data(gammas[0]->value, (void **)&job.gamma1));
    TRY(data(gammas[1]->value, (void **)&job.gamma2));
    if (bias->value != NULL)
        TRY(data(bias->value, (void **)&job.qkv_bias));
    int own;
    char *base = layer_scratch(layer_parts(&job, NULL), &own);
    if (base == NULL)
        return error(op, "out of memory for the layer's rows");
    layer_parts(&job, base);
    job.linear[DOWN].y = y;

    int64_t rows = (job.m + LAYER_ROWS - 1) / LAYER_ROWS, threads = run_width(&kernel->threads);
    phased_run run = {0};
    add_phase(&run, layer_norm1, &job, rows, 1);
    add_gemm(&run, layer_qkv, &job, lk[QKV].n, threads);
    add_phase(&run, layer_write, &job, 1, 1);
    add_phase(&run, layer_attend, &job, llmc_attention_tasks(a), 1);
    add_phase(&run, layer_combine, &job, a->splits > 1, 1);
    add_phase(&run, layer_quantize_o, &job, llmc_format_bits(lk[O].format) ? rows : 0, 1);
    add_gemm(&run, layer_o, &job, lk[O].n, threads);
    add_phase(&run, layer_norm2, &job, rows, 1);
    add_gemm(&run, layer_gate_up, &job, lk[GATE_UP].n, threads);
    add_phase(&run, layer_swiglu, &job, rows, 1);
    add_gemm(&run, layer_down, &job, lk[DOWN].n, threads);
    OrtStatus *status = run_phases(ctx, &run, &kernel->threads);
    layer_scratch_done(base, own);
    if (status == NULL && job.out_of_memory)
        status = error(op, "out of memory for the attention scratch");
    return status;
}
