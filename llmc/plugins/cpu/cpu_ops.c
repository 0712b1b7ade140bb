/* ONNX Runtime custom-op library: domain "llmc.cpu", ops PagedAttention, SwiGLU, PackedMatMul
 * (optionally with each row's argmax), SkipRMSNormMatMul, SwiGLUMatMul, DecoderLayer (a
 * layer's five of them as one node) and Experts (a mixture-of-experts layer's experts).
 * ORT calls RegisterCustomOps when a session registers this library; the kernels then run on
 * ORT's intra-op thread pool (KernelContext_ParallelFor), so they share its threads and spinning
 * settings instead of bringing threads of their own. */
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "ort_abi.h"

#define EXPORT __attribute__((visibility("default")))

static const OrtApi *api;
static int shape_by_reference; /* the ORT has GetTensorElementTypeAndShapeDataReference */

#define CALL(slot, type, ...) (((type)api[slot])(__VA_ARGS__))

static OrtStatus *error(const char *op, const char *message) {
    char text[256];
    snprintf(text, sizeof text, "llmc.cpu::%s: %s", op, message);
    return CALL(ORT_CreateStatus, ort_create_status_fn, ORT_INVALID_ARGUMENT, text);
}

/* Propagate a failed ORT call. */
#define TRY(expr)                     \
    do {                              \
        OrtStatus *status_ = (expr);  \
        if (status_ != NULL)          \
            return status_;           \
    } while (0)

typedef struct {
    const OrtValue *value;
    int64_t dims[8];
    size_t rank;
    int32_t type;
} tensor;

static OrtStatus *input(OrtKernelContext *ctx, size_t index, tensor *t) {
    memset(t, 0, sizeof *t);
    size_t count = 0;
    TRY(CALL(ORT_KernelContext_GetInputCount, ort_get_count_fn, ctx, &count));
    if (index >= count)
        return NULL;
    TRY(CALL(ORT_KernelContext_GetInput, ort_get_input_fn, ctx, index, &t->value));
    if (t->value == NULL)
        return NULL;
    if (shape_by_reference) {
        /* 1 call instead of 5 and a heap object, per input of each of a step's ops: a measurable
         * share of a batch-1 step (docs/attention_cpu.md, "Where a batch-1 step's time goes") */
        const int64_t *dims;
        TRY(CALL(ORT_GetTensorElementTypeAndShapeDataReference, ort_type_shape_ref_fn, t->value, &t->type, &dims,
                 &t->rank));
        if (t->rank > 8)
            return error("input", "tensor rank above 8");
        if (t->rank > 0)
            memcpy(t->dims, dims, t->rank * sizeof *dims);
        return NULL;
    }
    OrtTensorTypeAndShapeInfo *info;
    TRY(CALL(ORT_GetTensorTypeAndShape, ort_get_type_shape_fn, t->value, &info));
    OrtStatus *status = CALL(ORT_GetDimensionsCount, ort_get_dims_count_fn, info, &t->rank);
    if (status == NULL && t->rank > 8)
        status = error("input", "tensor rank above 8");
    if (status == NULL)
        status = CALL(ORT_GetDimensions, ort_get_dims_fn, info, t->dims, t->rank);
    if (status == NULL)
        status = CALL(ORT_GetTensorElementType, ort_get_elem_type_fn, info, &t->type);
    CALL(ORT_ReleaseTensorTypeAndShapeInfo, ort_release_fn, info);
    return status;
}

static OrtStatus *data(const OrtValue *value, void **out) {
    return CALL(ORT_GetTensorMutableData, ort_get_data_fn, (OrtValue *)value, out);
}

static OrtStatus *output(OrtKernelContext *ctx, size_t index, const int64_t *dims, size_t rank, void **out) {
    OrtValue *value;
    TRY(CALL(ORT_KernelContext_GetOutput, ort_get_output_fn, ctx, index, dims, rank, &value));
    return data(value, out);
}

/* The number of rows of x seen as [rows, last dim], and x's dims with the last one replaced. */
static int64_t rows_with_last(const tensor *x, int64_t last, int64_t dims[8]) {
    int64_t rows = 1;
    memcpy(dims, x->dims, sizeof x->dims);
    dims[x->rank - 1] = last;
    for (size_t i = 0; i + 1 < x->rank; i++)
        rows *= x->dims[i];
    return rows;
}

/* An op's temporary rows: decode's few fit on the stack, so the ops of a step make no allocator
 * calls (glibc consolidates its free lists on every request over 1 KB); more rows use the heap. */
typedef struct {
    _Alignas(64) uint8_t local[16384];
    void *heap;
} scratch;

static void *scratch_get(scratch *s, size_t bytes) {
    s->heap = NULL;
    return bytes <= sizeof s->local ? (void *)s->local : (s->heap = malloc(bytes));
}

static OrtStatus *parallel(OrtKernelContext *ctx, void (*fn)(void *, size_t), size_t total, void *arg) {
    return CALL(ORT_KernelContext_ParallelFor, ort_parallel_for_fn, ctx, fn, total, 0, arg);
}

/* -- PagedAttention -------------------------------------------------------------------------- */

enum {
    IN_Q, IN_K, IN_V, IN_CACHE, IN_PAST, IN_QLEN, IN_TABLES, IN_COS, IN_SIN, IN_POS, IN_Q_NORM, IN_K_NORM, IN_SINKS,
    NUM_IN
};

typedef struct {
    int64_t num_heads, num_kv_heads, sliding_window, interleaved;
    float scale, softcap, qk_norm_epsilon;
} attention_kernel;

static void attend_one(void *arg, size_t task) { llmc_attention_task((const llmc_attention *)arg, (int64_t)task); }

/* Q, then K and V, in each token's row of a merged QKV projection. */
static void packed_qkv(llmc_attention *a, const float *qkv) {
    a->q = qkv;
    a->k = qkv + a->num_heads * a->head_dim;
    a->v = a->k + a->num_kv_heads * a->head_dim;
}

/* The step's attention from the op's inputs t (the query's shape from t[IN_Q], its data from
 * q_data, which a packed query may leave NULL for the caller's packed_qkv): everything but the
 * output, the pool to write and the key splits. */
static OrtStatus *attention_setup(const char *op, const attention_kernel *kernel, const tensor t[NUM_IN],
                                  const float *q_data, llmc_attention *out) {
    const tensor *q = &t[IN_Q], *cache = &t[IN_CACHE];
    int packed = t[IN_K].value == NULL;
    if (q->rank != 3 || q->type != ORT_FLOAT)
        return error(op, "query must be float32 [batch, seq, heads * head_dim]");
    llmc_attention a = {0};
    /* The pool's element type is the engine's --kv-cache-dtype (kernels.h: the layouts). */
    a.kv_type = cache->type == ORT_FLOAT ? LLMC_KV_FP32 : cache->type == ORT_FLOAT16 ? LLMC_KV_FP16
              : cache->type == ORT_BFLOAT16 ? LLMC_KV_BF16 : cache->type == ORT_INT8 ? LLMC_KV_INT8 : -1;
    if (a.kv_type < 0)
        return error(op, "kv_cache must be float32, float16, bfloat16 or int8 (the engine's kv-cache dtype)");
    if (a.kv_type != LLMC_KV_INT8 && (cache->rank != 5 || cache->dims[0] != 2))
        return error(op, "kv_cache must be [2, num_blocks, kv_heads, block_size, head_dim]");
    if (a.kv_type == LLMC_KV_INT8 && (cache->rank != 4 || cache->dims[0] != 2))
        return error(op, "an int8 kv_cache must be [2, num_blocks, kv_heads, block_size * (head_dim + 4)]");
    a.batch = q->dims[0];
    a.seq = q->dims[1];
    a.num_heads = kernel->num_heads;
    a.num_kv_heads = kernel->num_kv_heads;
    a.num_blocks = cache->dims[1];
    if (a.kv_type == LLMC_KV_INT8) {  /* the tiles do not say their head_dim: the query does */
        int64_t per_token = packed ? a.num_heads + 2 * a.num_kv_heads : a.num_heads;
        if (q->dims[2] % per_token != 0)
            return error(op, "query's last dim does not match the heads and head_dim");
        a.head_dim = q->dims[2] / per_token;
        a.block_size = a.head_dim > 0 ? cache->dims[3] / (a.head_dim + 4) : 0;
        if (a.block_size * (a.head_dim + 4) != cache->dims[3])
            return error(op, "an int8 kv_cache's last dim must be block_size * (head_dim + 4)");
    } else {
        a.block_size = cache->dims[3];
        a.head_dim = cache->dims[4];
    }
    if (a.num_blocks < 1 || a.block_size < 1 || a.head_dim < 1)
        return error(op, "kv_cache has an empty dimension");
    if (cache->dims[2] != a.num_kv_heads || a.num_heads % a.num_kv_heads != 0)
        return error(op, "kv_cache's head count does not match num_kv_heads");
    if (a.head_dim > LLMC_MAX_HEAD_DIM)
        return error(op, "head_dim above 512 is not supported");
    int64_t d = a.head_dim, hq = a.num_heads * d, hkv = a.num_kv_heads * d;
    if (q->dims[2] != (packed ? hq + 2 * hkv : hq))
        return error(op, "query's last dim does not match the heads and head_dim");
    if (!packed) {
        for (int i = IN_K; i <= IN_V; i++)
            if (t[i].rank != 3 || t[i].type != ORT_FLOAT || t[i].dims[0] != a.batch || t[i].dims[1] != a.seq ||
                t[i].dims[2] != hkv)
                return error(op, "key/value must be float32 [batch, seq, kv_heads * head_dim]");
    }
    const tensor *past = &t[IN_PAST], *qlen = &t[IN_QLEN], *tables = &t[IN_TABLES];
    if (past->rank != 1 || qlen->rank != 1 || tables->rank != 2 || past->dims[0] != a.batch ||
        qlen->dims[0] != a.batch || tables->dims[0] != a.batch || past->type != ORT_INT32 ||
        qlen->type != ORT_INT32 || tables->type != ORT_INT32)
        return error(op, "past_lens/query_lens [batch] and block_tables [batch, blocks] must be int32");
    a.max_blocks = tables->dims[1];
    if (t[IN_COS].value != NULL) {
        const tensor *c = &t[IN_COS], *s = &t[IN_SIN], *pos = &t[IN_POS];
        int alike = s->value != NULL && c->type == ORT_FLOAT && s->type == ORT_FLOAT && c->rank == s->rank &&
                    memcmp(c->dims, s->dims, sizeof c->dims) == 0;
        if (pos->value != NULL) {  /* tables indexed by position */
            if (!alike || c->rank != 2 || 2 * c->dims[1] > d)
                return error(op, "with positions, cos/sin must be float32 tables [positions, rotary_dim / 2] with "
                                 "rotary_dim <= head_dim");
            if (pos->rank != 2 || pos->type != ORT_INT64 || pos->dims[0] != a.batch || pos->dims[1] != a.seq)
                return error(op, "positions must be int64 [batch, seq]");
            a.rotary_rows = c->dims[0];
            TRY(data(pos->value, (void **)&a.positions));
        } else {
            if (!alike || c->rank != 3 || (c->dims[0] != a.batch && c->dims[0] != 1) || c->dims[1] != a.seq ||
                2 * c->dims[2] > d)
                return error(op, "cos/sin must be float32 [batch or 1, seq, rotary_dim / 2] with rotary_dim <= head_dim");
            a.cos_batch_stride = c->dims[0] == 1 ? 0 : a.seq * c->dims[2];
        }
        a.rotary_dim = 2 * c->dims[c->rank - 1];
        TRY(data(c->value, (void **)&a.cos));
        TRY(data(s->value, (void **)&a.sin));
    }
    if ((t[IN_Q_NORM].value == NULL) != (t[IN_K_NORM].value == NULL))
        return error(op, "q_norm and k_norm come together (QK-norm) or not at all");
    if (t[IN_Q_NORM].value != NULL) {
        for (int i = IN_Q_NORM; i <= IN_K_NORM; i++)
            if (t[i].type != ORT_FLOAT || t[i].rank != 1 || t[i].dims[0] != d)
                return error(op, "q_norm and k_norm must be float32 [head_dim]");
        TRY(data(t[IN_Q_NORM].value, (void **)&a.q_norm));
        TRY(data(t[IN_K_NORM].value, (void **)&a.k_norm));
        a.norm_eps = kernel->qk_norm_epsilon;
    }
    if (t[IN_SINKS].value != NULL) {
        if (t[IN_SINKS].type != ORT_FLOAT || t[IN_SINKS].rank != 1 || t[IN_SINKS].dims[0] != a.num_heads)
            return error(op, "sinks must be float32 [num_heads]");
        TRY(data(t[IN_SINKS].value, (void **)&a.sinks));
    }
    a.interleaved = (int)kernel->interleaved;
    a.scale = kernel->scale;
    a.softcap = kernel->softcap;
    a.sliding_window = kernel->sliding_window;
    if (packed) {
        a.q_stride = a.kv_stride = hq + 2 * hkv;
        if (q_data != NULL)
            packed_qkv(&a, q_data);
    } else {
        a.q = q_data;
        a.q_stride = hq;
        a.kv_stride = hkv;
        TRY(data(t[IN_K].value, (void **)&a.k));
        TRY(data(t[IN_V].value, (void **)&a.v));
    }
    TRY(data(past->value, (void **)&a.past_lens));
    TRY(data(qlen->value, (void **)&a.query_lens));
    TRY(data(tables->value, (void **)&a.block_tables));
    const char *problem = llmc_attention_check(&a);
    if (problem != NULL)
        return error(op, problem);
    /* Decode rows attend one query each; prefill chunks take query rows in tiles that share
     * each key block while it is in cache. */
    a.rows_per_task = a.seq == 1 ? 1 : 16;
    a.splits = llmc_attention_splits(&a);
    *out = a;
    return NULL;
}

/* The pool output (output `index`), aliased to the pool input by the runtime's binding; where it
 * is not (a plain session.run), the pool is carried over first. */
static OrtStatus *attention_pool(OrtKernelContext *ctx, const tensor *cache, size_t index, llmc_attention *a) {
    void *cache_in;
    TRY(data(cache->value, &cache_in));
    TRY(output(ctx, index, cache->dims, cache->rank, &a->cache));
    if (a->cache != cache_in)
        memcpy(a->cache, cache_in, (size_t)(2 * a->num_blocks * a->num_kv_heads * llmc_attention_tile_bytes(a)));
    return NULL;
}

static OrtStatus *attention_compute(void *state, OrtKernelContext *ctx) {
    const char *op = "PagedAttention";
    tensor t[NUM_IN];
    for (size_t i = 0; i < NUM_IN; i++)
        TRY(input(ctx, i, &t[i]));
    float *q_data;
    TRY(data(t[IN_Q].value, (void **)&q_data));
    llmc_attention a;
    TRY(attention_setup(op, state, t, q_data, &a));
    int64_t out_dims[3] = {a.batch, a.seq, a.num_heads * a.head_dim};
    TRY(output(ctx, 0, out_dims, 3, (void **)&a.out));
    TRY(attention_pool(ctx, &t[IN_CACHE], 1, &a));
    llmc_attention_write(&a);
    scratch partial;
    a.partial = scratch_get(&partial, (size_t)llmc_attention_partial_floats(&a) * sizeof(float));
    if (a.splits > 1 && a.partial == NULL)
        return error(op, "out of memory for the attention scratch");
    int out_of_memory = 0;
    a.out_of_memory = &out_of_memory;
    OrtStatus *status = parallel(ctx, attend_one, (size_t)llmc_attention_tasks(&a), &a);
    if (status == NULL && !out_of_memory && a.splits > 1)
        llmc_attention_combine(&a);
    free(partial.heap);
    if (status != NULL)
        return status;
    return out_of_memory ? error(op, "out of memory for the attention scratch") : NULL;
}

/* -- SwiGLU ------------------------------------------------------------------------------------ */

typedef struct {
    const float *x;
    float *out;
    int64_t width, rows, rows_per_task;
    int activation; /* LLMC_ACT_* */
} swiglu_job;

static void swiglu_one(void *arg, size_t task) {
    const swiglu_job *job = arg;
    int64_t row0 = (int64_t)task * job->rows_per_task, row1 = row0 + job->rows_per_task;
    llmc_swiglu_rows(job->x, job->out, job->width, row0, row1 < job->rows ? row1 : job->rows, job->activation);
}

/* out[rows, width] = act(gate) * up of x[rows, 2 * width]: a decode row is too little work to
 * split; prefill rows go in groups of 8. */
static OrtStatus *swiglu_rows(OrtKernelContext *ctx, const float *x, float *out, int64_t width, int64_t rows,
                              int64_t activation) {
    swiglu_job job = {.x = x, .out = out, .width = width, .rows = rows, .rows_per_task = rows < 8 ? rows : 8,
                      .activation = (int)activation};
    if (rows == 0)
        return NULL;
    return parallel(ctx, swiglu_one, (size_t)((rows + job.rows_per_task - 1) / job.rows_per_task), &job);
}

static OrtStatus *swiglu_compute(void *state, OrtKernelContext *ctx) {
    const int64_t *activation = state;
    tensor x;
    TRY(input(ctx, 0, &x));
    if (x.type != ORT_FLOAT || x.rank < 1 || x.dims[x.rank - 1] % 2 != 0)
        return error("SwiGLU", "input must be float32 with an even last dim (gate then up)");
    int64_t dims[8], rows = rows_with_last(&x, x.dims[x.rank - 1] / 2, dims);
    const float *in;
    float *out;
    TRY(data(x.value, (void **)&in));
    TRY(output(ctx, 0, dims, x.rank, (void **)&out));
    return swiglu_rows(ctx, in, out, dims[x.rank - 1], rows, *activation);
}

/* Rows of x quantized into act, 8 rows a task (the linear ops' and Experts' phases). */
typedef struct {
    const llmc_qact *act;
    const float *x;
} quantize_job;

static void quantize_one(void *arg, size_t task) {
    const quantize_job *q = arg;
    int64_t row0 = (int64_t)task * 8, row1 = row0 + 8;
    llmc_quantize_rows(q->act, q->x, row0, row1 < q->act->m ? row1 : q->act->m);
}

/* -- Experts ----------------------------------------------------------------------------------- */

typedef struct {
    int64_t activation, packed, format, block_size, zero_points;
    float alpha, limit;
} experts_kernel;

typedef struct {
    const llmc_experts *a;
    int down; /* the phase: up products, or down products */
    int64_t groups, groups_per_task, tasks_per_expert;
} experts_job;

static void experts_one(void *arg, size_t task) {
    const experts_job *job = arg;
    int64_t u = (int64_t)task / job->tasks_per_expert;
    int64_t g0 = (int64_t)task % job->tasks_per_expert * job->groups_per_task, g1 = g0 + job->groups_per_task;
    int64_t e = job->a->used[u];
    (job->down ? llmc_experts_down : llmc_experts_up)(job->a, e, g0, g1 < job->groups ? g1 : job->groups);
}

/* One phase's products: for a quantized format its rows quantized first; then each chosen
 * expert's columns in groups, about 4 tasks per CPU in all. */
static OrtStatus *experts_products(OrtKernelContext *ctx, const llmc_experts *a, int down) {
    if (llmc_format_bits(a->format)) {
        quantize_job q = {.act = down ? &a->down_rows : &a->up_rows, .x = down ? a->act : a->rows};
        TRY(parallel(ctx, quantize_one, (size_t)((q.act->m + 7) / 8), &q));
    }
    experts_job job = {.a = a, .down = down, .groups = llmc_experts_groups(down ? a->hidden : 2 * a->inter)};
    int64_t want = 4 * llmc_cpus(), per_expert = (want + a->num_used - 1) / a->num_used;
    job.groups_per_task = (job.groups + per_expert - 1) / per_expert;
    job.tasks_per_expert = (job.groups + job.groups_per_task - 1) / job.groups_per_task;
    return parallel(ctx, experts_one, (size_t)(a->num_used * job.tasks_per_expert), &job);
}

static void experts_activate_one(void *arg, size_t task) {
    const llmc_experts *a = arg;
    int64_t r0 = (int64_t)task * 8, r1 = r0 + 8, pairs = a->tokens * a->top_k;
    llmc_experts_activate(a, r0, r1 < pairs ? r1 : pairs);
}

static void experts_combine_one(void *arg, size_t task) {
    const llmc_experts *a = arg;
    int64_t t0 = (int64_t)task * 8, t1 = t0 + 8;
    llmc_experts_combine(a, t0, t1 < a->tokens ? t1 : a->tokens);
}

/* The expert weights' sizes (a.inter) from their shapes, checked against each other and x; NULL
 * or what is wrong. fp32: [E, 2 inter, hidden] and [E, hidden, inter], or 4-D panels (packed);
 * quantized: [E, bytes] uint8 each, inter read from down's bytes per expert. */
static const char *experts_shapes(const experts_kernel *k, const tensor *gate_up, const tensor *down,
                                  llmc_experts *a) {
    const int format = (int)k->format;
    if (gate_up->dims[0] != a->experts || down->dims[0] != a->experts)
        return "gate_up and down must hold the same number of experts";
    if (llmc_format_bits(format)) {
        int64_t block_bytes = llmc_quant_block_bytes(format, k->block_size, (int)k->zero_points);
        int64_t per_block_row = llmc_experts_groups(a->hidden) * block_bytes;
        if (gate_up->rank != 2 || down->rank != 2 || gate_up->type != ORT_UINT8 || down->type != ORT_UINT8 ||
            down->dims[1] % per_block_row != 0 || a->hidden % k->block_size != 0)
            return "quantized expert weights must be [experts, bytes] uint8 blobs, hidden a multiple of block_size";
        a->inter = down->dims[1] / per_block_row * k->block_size;
        if (down->dims[1] != llmc_quant_bytes(a->inter, a->hidden, format, k->block_size, (int)k->zero_points) ||
            gate_up->dims[1] != llmc_quant_bytes(a->hidden, 2 * a->inter, format, k->block_size, (int)k->zero_points))
            return "the quantized gate_up and down blobs disagree on the experts' sizes";
        return NULL;
    }
    size_t rank = k->packed ? 4 : 3;
    if (gate_up->rank != rank || down->rank != rank || gate_up->type != ORT_FLOAT || down->type != ORT_FLOAT)
        return "fp32 expert weights must be [experts, 2 inter, hidden] and [experts, hidden, inter] float32 "
               "(packed: 4-D panels)";
    a->inter = down->dims[2];
    int agree = k->packed ? gate_up->dims[2] == a->hidden && gate_up->dims[3] == LLMC_PANEL &&
                                gate_up->dims[1] == llmc_experts_groups(2 * a->inter) &&
                                down->dims[1] == llmc_experts_groups(a->hidden) && down->dims[3] == LLMC_PANEL
                          : gate_up->dims[2] == a->hidden && gate_up->dims[1] == 2 * a->inter &&
                                down->dims[1] == a->hidden;
    return agree ? NULL : "gate_up and down disagree with x on the hidden size, or with each other on inter";
}

static OrtStatus *experts_compute(void *state, OrtKernelContext *ctx) {
    const experts_kernel *k = state;
    tensor x, ids, weights, gate_up, down, bias[2];
    TRY(input(ctx, 0, &x));
    TRY(input(ctx, 1, &ids));
    TRY(input(ctx, 2, &weights));
    TRY(input(ctx, 3, &gate_up));
    TRY(input(ctx, 4, &down));
    TRY(input(ctx, 5, &bias[0]));
    TRY(input(ctx, 6, &bias[1]));
    if (x.rank != 2 || ids.rank != 2 || weights.rank != 2 || x.type != ORT_FLOAT || ids.type != ORT_INT64 ||
        weights.type != ORT_FLOAT || ids.dims[0] != x.dims[0] || weights.dims[0] != x.dims[0] ||
        weights.dims[1] != ids.dims[1] || ids.dims[1] < 1 || gate_up.rank < 2 || down.rank < 2)
        return error("Experts", "x must be [tokens, hidden] float32, ids [tokens, top_k] int64 and weights "
                                "[tokens, top_k] float32");
    llmc_experts a = {.tokens = x.dims[0], .top_k = ids.dims[1], .hidden = x.dims[1], .experts = gate_up.dims[0],
                      .packed = (int)k->packed, .activation = (int)k->activation, .format = (int)k->format,
                      .zero_points = (int)k->zero_points, .block_size = k->block_size, .alpha = k->alpha,
                      .limit = k->limit};
    const char *problem = experts_shapes(k, &gate_up, &down, &a);
    if (problem != NULL)
        return error("Experts", problem);
    const float **biases[2] = {&a.gate_up_bias, &a.down_bias};
    for (int i = 0; i < 2; i++) {
        if (bias[i].value == NULL)
            continue;
        if (bias[i].type != ORT_FLOAT || bias[i].rank != 2 || bias[i].dims[0] != a.experts ||
            bias[i].dims[1] != (i == 0 ? 2 * a.inter : a.hidden))
            return error("Experts", "gate_up_bias must be float32 [experts, 2 inter] and down_bias [experts, hidden]");
        TRY(data(bias[i].value, (void **)biases[i]));
    }
    TRY(data(x.value, (void **)&a.x));
    TRY(data(ids.value, (void **)&a.ids));
    TRY(data(weights.value, (void **)&a.weights));
    TRY(data(gate_up.value, (void **)&a.gate_up));
    TRY(data(down.value, (void **)&a.down));
    int64_t dims[2] = {a.tokens, a.hidden};
    TRY(output(ctx, 0, dims, 2, (void **)&a.out));
    if (a.tokens == 0)
        return NULL;
    int64_t pairs = a.tokens * a.top_k;
    int quantized = llmc_format_bits(a.format) != 0;
    size_t ints = (size_t)(2 * a.experts + 1 + 2 * pairs), floats = (size_t)(pairs * (2 * a.hidden + 3 * a.inter));
    size_t act_bytes = quantized ? (size_t)(llmc_qact_bytes(pairs, a.hidden, a.block_size) +
                                            llmc_qact_bytes(pairs, a.inter, a.block_size)) : 0;
    int64_t *scratch = malloc(ints * sizeof(int64_t) + floats * sizeof(float) + act_bytes + 64);
    if (scratch == NULL)
        return error("Experts", "out of memory for the step's expert rows");
    a.start = scratch;
    a.used = a.start + a.experts + 1;
    a.slot = a.used + a.experts;
    a.row_of = a.slot + pairs;
    a.rows = (float *)(a.row_of + pairs);
    a.gate_up_out = a.rows + pairs * a.hidden;
    a.act = a.gate_up_out + pairs * 2 * a.inter;
    a.down_out = a.act + pairs * a.inter;
    if (quantized) {
        uint8_t *q = (uint8_t *)(((uintptr_t)(a.down_out + pairs * a.hidden) + 63) & ~(uintptr_t)63);
        llmc_qact_init(&a.up_rows, q, pairs, a.hidden, a.block_size);
        llmc_qact_init(&a.down_rows, q + llmc_qact_bytes(pairs, a.hidden, a.block_size), pairs, a.inter,
                       a.block_size);
    }
    problem = llmc_experts_plan(&a);
    OrtStatus *status = problem != NULL ? error("Experts", problem) : experts_products(ctx, &a, 0);
    if (status == NULL)
        status = parallel(ctx, experts_activate_one, (size_t)((pairs + 7) / 8), &a);
    if (status == NULL)
        status = experts_products(ctx, &a, 1);
    if (status == NULL)
        status = parallel(ctx, experts_combine_one, (size_t)((a.tokens + 7) / 8), &a);
    free(scratch);
    return status;
}

/* -- PackedMatMul ------------------------------------------------------------------------------ */

typedef struct {
    int64_t n;
    int64_t format, block_size, zero_points; /* the weight's format (LLMC_FORMAT_*, kernels.h) */
    float epsilon; /* SkipRMSNormMatMul's */
    int64_t activation; /* SwiGLUMatMul's gate activation (LLMC_ACT_*) */
} linear_kernel;

typedef struct {
    const float *x, *w;
    const uint8_t *lossless; /* the weight's lossless copy, when the op has one and m is small */
    const void *packed;      /* a 16-bit or quantized weight (format != 0) */
    llmc_qact act;           /* quantized formats: the rows, quantized once per call */
    int format, zero_points;
    float *y;
    int64_t m, k, n;
    float *best;       /* with an argmax output: per panel and row, the panel's largest value... */
    int32_t *best_at;  /* ...and its column, the first one on ties */
} linear_job;

static int64_t panels_of(int64_t n) { return (n + LLMC_PANEL - 1) / LLMC_PANEL; }

/* A quantized format's name, for messages. */
static const char *quant_name(int format) {
    return format == LLMC_FORMAT_MXFP4 ? "mxfp4" : format == LLMC_FORMAT_INT8 ? "int8"
                                                  : format == LLMC_FORMAT_INT6 ? "int6" : "int4";
}

/* x [.., K] against a weight packed for n output columns in the kernel's format: [ceil(n / 32), K,
 * 32] float32 or uint16 panels, or a quantized uint8 blob of llmc_quant_bytes. Sets *k. */
static OrtStatus *check_packed(const char *op, const linear_kernel *kernel, const tensor *x, const tensor *w,
                               int64_t *k) {
    if (x->type != ORT_FLOAT || x->rank < 1)
        return error(op, "input must be float32");
    int format = (int)kernel->format;
    if (llmc_format_bits(format)) {
        *k = x->dims[x->rank - 1];
        if (*k % kernel->block_size != 0)
            return error(op, "input's last dim (K) is not a multiple of the weight's block_size");
        int64_t bytes = llmc_quant_bytes(*k, kernel->n, format, kernel->block_size, (int)kernel->zero_points);
        if (w->type != ORT_UINT8 || w->rank != 1 || w->dims[0] != bytes) {
            char message[200];
            snprintf(message, sizeof message,
                     "%s weight must be a 1-D uint8 blob of %lld bytes for K = %lld (the input's last dim), "
                     "n = %lld, block_size %lld, zero_points %lld (packed by llmc build)",
                     quant_name(format), (long long)bytes, (long long)*k, (long long)kernel->n,
                     (long long)kernel->block_size, (long long)kernel->zero_points);
            return error(op, message);
        }
        return NULL;
    }
    int sixteen = format == LLMC_FORMAT_BF16 || format == LLMC_FORMAT_FP16;
    int32_t half_type = format == LLMC_FORMAT_BF16 ? ORT_BFLOAT16 : ORT_FLOAT16;
    int type_ok = sixteen ? (w->type == ORT_UINT16 || w->type == half_type) : w->type == ORT_FLOAT;
    if (!type_ok || w->rank != 3 || w->dims[2] != LLMC_PANEL || w->dims[0] != panels_of(kernel->n))
        return error(op, sixteen ? "16-bit weight must be uint16 [ceil(n / 32), K, 32] (packed by llmc build)"
                                 : "weight must be float32 [ceil(n / 32), K, 32] (packed by llmc build)");
    if (x->dims[x->rank - 1] != w->dims[1])
        return error(op, "input's last dim does not match the weight's K");
    *k = w->dims[1];
    return NULL;
}

/* Whether v beats the best so far as numpy's argmax ranks values: NaN above everything (the first
 * NaN wins), otherwise the larger, the earlier on ties. */
static inline int beats(float v, float best) { return v > best || (v != v && best == best); }

/* The largest value of each row within one panel's columns, while they are still in cache. */
static void panel_argmax(const linear_job *job, int64_t panel) {
    int64_t c0 = panel * LLMC_PANEL, c1 = c0 + LLMC_PANEL < job->n ? c0 + LLMC_PANEL : job->n;
    for (int64_t r = 0; r < job->m; r++) {
        const float *row = job->y + r * job->n;
        int64_t at = c0;
        for (int64_t c = c0 + 1; c < c1; c++)
            if (beats(row[c], row[at]))
                at = c;
        job->best[panel * job->m + r] = row[at];
        job->best_at[panel * job->m + r] = at;
    }
}

/* Each row's argmax from the panels' maxima, panels in column order. */
static void reduce_argmax(const linear_job *job, int64_t *out) {
    int64_t entries = panels_of(job->n) * job->m;
    for (int64_t r = 0; r < job->m; r++) {
        int64_t best = r;
        for (int64_t i = r + job->m; i < entries; i += job->m)
            if (beats(job->best[i], job->best[best]))
                best = i;
        out[r] = job->best_at[best];
    }
}

static void linear_panel(const linear_job *job, int64_t panel) {
    if (llmc_format_bits(job->format))
        llmc_linear_quant(&job->act, job->packed, job->y, job->n, job->format, job->zero_points, panel, panel + 1);
    else if (job->format != LLMC_FORMAT_FP32)
        llmc_linear_16bit(job->x, job->packed, job->y, job->m, job->k, job->n, job->format == LLMC_FORMAT_BF16,
                          panel, panel + 1);
    else if (job->lossless != NULL)
        llmc_linear_lossless(job->x, job->lossless, job->y, job->m, job->k, job->n, panel, panel + 1);
    else
        llmc_linear_panels(job->x, job->w, job->y, job->m, job->k, job->n, panel, panel + 1);
}

static void linear_one(void *arg, size_t panel) {
    const linear_job *job = arg;
    linear_panel(job, (int64_t)panel);
    if (job->best != NULL)
        panel_argmax(job, (int64_t)panel);
}

/* The optional last input: the weight in the lossless format (kernels.h), checked against the
 * fp32 weight's shape. The job reads it when it has few rows, where the weight stream bounds the
 * time; with more, the FMAs do, and the fp32 weight needs no decoding. */
static OrtStatus *lossless_input(OrtKernelContext *ctx, const char *op, size_t index, linear_job *job) {
    tensor t;
    TRY(input(ctx, index, &t));
    if (t.value == NULL)
        return NULL;
    if (job->format != LLMC_FORMAT_FP32)
        return error(op, "a lossless weight copy applies only to weight_format 0 (float32)");
    const uint8_t *blob;
    TRY(data(t.value, (void **)&blob));
    int64_t head = llmc_lossless_bytes(job->k, job->n, 0);
    if (t.type != ORT_UINT8 || t.rank != 1 || job->k % 4 != 0 || t.dims[0] < head)
        return error(op, "the lossless weight does not match the fp32 weight's shape; rebuild the engine");
    int32_t exceptions;
    memcpy(&exceptions, blob + head - 4, sizeof exceptions);  /* the last of the exception offsets */
    if (exceptions < 0 || t.dims[0] != llmc_lossless_bytes(job->k, job->n, exceptions))
        return error(op, "the lossless weight's size disagrees with its exception count; rebuild the engine");
    if (job->m <= LLMC_LOSSLESS_MAX_ROWS && llmc_lossless_supported())
        job->lossless = blob;
    return NULL;
}

/* The product over the job's panels, in parallel: quantized formats first quantize the rows once
 * (in parallel too when there are many) into a scratch every panel task reads. */
static OrtStatus *run_linear(OrtKernelContext *ctx, const char *op, const linear_kernel *kernel, linear_job *job) {
    if (job->m == 0)
        return NULL;
    if (!llmc_format_bits(job->format))
        return parallel(ctx, linear_one, (size_t)panels_of(job->n), job);
    scratch buffer;
    void *rows = scratch_get(&buffer, (size_t)llmc_qact_bytes(job->m, job->k, kernel->block_size));
    if (rows == NULL)
        return error(op, "out of memory for the quantized rows");
    llmc_qact_init(&job->act, rows, job->m, job->k, kernel->block_size);
    quantize_job q = {.act = &job->act, .x = job->x};
    OrtStatus *status = NULL;
    if (job->m < 16)
        llmc_quantize_rows(&job->act, job->x, 0, job->m);
    else
        status = parallel(ctx, quantize_one, (size_t)((job->m + 7) / 8), &q);
    if (status == NULL)
        status = parallel(ctx, linear_one, (size_t)panels_of(job->n), job);
    free(buffer.heap);
    return status;
}

/* The job's weight: the fp32 panels, or (format != 0) the 16-bit panels or quantized blob. */
static OrtStatus *weight_data(const linear_kernel *kernel, const tensor *w, linear_job *job) {
    job->format = (int)kernel->format;
    job->zero_points = (int)kernel->zero_points;
    if (kernel->format == LLMC_FORMAT_FP32)
        return data(w->value, (void **)&job->w);
    return data(w->value, (void **)&job->packed);
}

static OrtStatus *linear_compute(void *state, OrtKernelContext *ctx) {
    const linear_kernel *kernel = state;
    const char *op = "PackedMatMul";
    tensor x, w;
    TRY(input(ctx, 0, &x));
    TRY(input(ctx, 1, &w));
    int64_t dims[8], k;
    TRY(check_packed(op, kernel, &x, &w, &k));
    linear_job job = {.k = k, .n = kernel->n, .m = rows_with_last(&x, kernel->n, dims)};
    TRY(data(x.value, (void **)&job.x));
    TRY(weight_data(kernel, &w, &job));
    TRY(output(ctx, 0, dims, x.rank, (void **)&job.y));
    TRY(lossless_input(ctx, op, 2, &job));
    size_t outputs;
    TRY(CALL(ORT_KernelContext_GetOutputCount, ort_get_count_fn, ctx, &outputs));
    if (outputs < 2)
        return run_linear(ctx, op, kernel, &job);
    /* The optional second output, each row's argmax (the LM head's greedy token): taken per panel
     * by the task that computed it, while in cache, so no one rereads the [m, n] product. */
    int64_t *argmax;
    TRY(output(ctx, 1, dims, x.rank - 1, (void **)&argmax));
    size_t entries = (size_t)(panels_of(job.n) * job.m);
    scratch buffer;
    job.best = scratch_get(&buffer, entries * (sizeof *job.best + sizeof *job.best_at));
    if (job.best == NULL)
        return error(op, "out of memory for the argmax");
    job.best_at = (int32_t *)(job.best + entries);
    OrtStatus *status = run_linear(ctx, op, kernel, &job);
    if (status == NULL)
        reduce_argmax(&job, argmax);
    free(buffer.heap);
    return status;
}

/* -- SkipRMSNormMatMul: a residual add and RMSNorm, then PackedMatMul on the normed rows --------- */

static OrtStatus *norm_linear_compute(void *state, OrtKernelContext *ctx) {
    const linear_kernel *kernel = state;
    const char *op = "SkipRMSNormMatMul";
    tensor x, skip, gamma, w;
    TRY(input(ctx, 0, &x));
    TRY(input(ctx, 1, &skip));
    TRY(input(ctx, 2, &gamma));
    TRY(input(ctx, 3, &w));
    int64_t dims[8], k;
    TRY(check_packed(op, kernel, &x, &w, &k));
    if (skip.type != ORT_FLOAT || skip.rank != x.rank || memcmp(skip.dims, x.dims, sizeof x.dims) != 0 ||
        gamma.type != ORT_FLOAT || gamma.rank != 1 || gamma.dims[0] != k)
        return error(op, "skip must match the input's shape and gamma be [K]");
    linear_job job = {.k = k, .n = kernel->n, .m = rows_with_last(&x, kernel->n, dims)};
    const float *x_data, *skip_data, *gamma_data;
    float *sum;
    TRY(data(x.value, (void **)&x_data));
    TRY(data(skip.value, (void **)&skip_data));
    TRY(data(gamma.value, (void **)&gamma_data));
    TRY(weight_data(kernel, &w, &job));
    TRY(output(ctx, 0, dims, x.rank, (void **)&job.y));
    TRY(output(ctx, 1, x.dims, x.rank, (void **)&sum));
    TRY(lossless_input(ctx, op, 4, &job));
    if (job.m == 0)
        return NULL;
    scratch buffer;
    float *normed = scratch_get(&buffer, (size_t)(job.m * job.k) * sizeof(float));
    if (normed == NULL)
        return error(op, "out of memory for the normed rows");
    /* The norm is a sliver of the work (one pass over the rows); the GEMM is split over panels. */
    llmc_skip_rmsnorm_rows(x_data, skip_data, gamma_data, sum, normed, job.k, kernel->epsilon, 0, job.m);
    job.x = normed;
    OrtStatus *status = run_linear(ctx, op, kernel, &job);
    free(buffer.heap);
    return status;
}

/* -- SwiGLUMatMul: PackedMatMul on silu(gate) * up of the merged gate/up rows ------------------- */

static OrtStatus *swiglu_linear_compute(void *state, OrtKernelContext *ctx) {
    const linear_kernel *kernel = state;
    const char *op = "SwiGLUMatMul";
    tensor x, w;
    TRY(input(ctx, 0, &x));
    TRY(input(ctx, 1, &w));
    if (x.rank < 1 || x.dims[x.rank - 1] % 2 != 0)
        return error(op, "input must have an even last dim (gate then up)");
    tensor halves = x;  /* what the product reads: [.., K] */
    halves.dims[x.rank - 1] /= 2;
    int64_t dims[8], k;
    TRY(check_packed(op, kernel, &halves, &w, &k));
    linear_job job = {.k = k, .n = kernel->n, .m = rows_with_last(&x, kernel->n, dims)};
    const float *x_data;
    TRY(data(x.value, (void **)&x_data));
    TRY(weight_data(kernel, &w, &job));
    TRY(output(ctx, 0, dims, x.rank, (void **)&job.y));
    TRY(lossless_input(ctx, op, 2, &job));
    if (job.m == 0)
        return NULL;
    scratch buffer;
    float *h = scratch_get(&buffer, (size_t)(job.m * job.k) * sizeof(float));
    if (h == NULL)
        return error(op, "out of memory for the activated rows");
    OrtStatus *status = swiglu_rows(ctx, x_data, h, job.k, job.m, kernel->activation);
    job.x = h;
    if (status == NULL)
        status = run_linear(ctx, op, kernel, &job);
    free(buffer.heap);
    return status;
}

/* -- Phased runs: a chain of dependent steps in one parallel call --------------------------------
 * DecoderLayer's steps (norms, quantized rows, GEMM panels, attention tasks) are one list of items
 * in phases. Items are claimed in order from one counter, and an item starts once every item of
 * the phases before its own is done. A thread only ever waits for items already claimed, whose
 * threads are running them, so the run cannot deadlock however many of ORT's threads join it (one
 * thread alone runs every item in order). What it saves is one ORT node and one ParallelFor per
 * step (docs/attention_cpu.md, "One node per layer"). */

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

/* ORT calls phased_worker once per CPU (it cannot say how many threads its pool has); a thread
 * joins a run once, marked by the run's number. */
static _Atomic uint64_t run_seq;
static _Thread_local uint64_t joined_run;

/* A phase of `items`, claimed `chunk` at a time: a run of consecutive panels streams as one. */
static void add_phase(phased_run *r, void (*run)(void *, int64_t), void *arg, int64_t items, int64_t chunk) {
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

/* The threads a node's run can expect: as many as its last run had (`*threads`, kept per node:
 * a draft engine's one-thread session and its target's take turns in one process), at first one
 * per CPU. */
static int64_t run_width(_Atomic int64_t *threads) {
    int64_t last = atomic_load_explicit(threads, memory_order_relaxed);
    return last > 0 ? last : workers();
}

static OrtStatus *run_phases(OrtKernelContext *ctx, phased_run *r, _Atomic int64_t *threads) {
    r->seq = atomic_fetch_add_explicit(&run_seq, 1, memory_order_relaxed) + 1;
    OrtStatus *status = parallel(ctx, phased_worker, (size_t)workers(), r);
    int64_t joined = atomic_load_explicit(&r->joined.value, memory_order_relaxed);
    atomic_store_explicit(threads, joined < MAX_WORKERS ? joined : MAX_WORKERS, memory_order_relaxed);
    return status;
}

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

/* -- DecoderLayer: a whole pre-norm decoder layer in one node ----------------------------------
 * SkipRMSNormMatMul (QKV) -> PagedAttention (packed QKV) -> PackedMatMul (O) -> SkipRMSNormMatMul
 * (gate/up) -> SwiGLUMatMul (down), the same kernels in the same order, so the outputs are those
 * of the five nodes bit for bit. Outputs: the down projection, the residual stream after the
 * attention (the next layer's skip and x), and the pool. */

enum {
    L_X, L_SKIP, L_GAMMA1, L_W_QKV, L_CACHE, L_PAST, L_QLEN, L_TABLES, L_COS, L_SIN, L_POS, L_W_O, L_GAMMA2,
    L_W_GATE_UP, L_W_DOWN, L_QKV_BIAS, L_LOSSLESS, /* then the four lossless copies, QKV to down */
    L_Q_NORM = L_LOSSLESS + 4, L_K_NORM, /* the attention's QK-norm weights */
    L_NUM_IN
};
enum { QKV, O, GATE_UP, DOWN, LINEARS };
static const char *const linear_prefix[LINEARS] = {"qkv_", "o_", "gate_up_", "down_"};

typedef struct {
    attention_kernel attention;
    linear_kernel linear[LINEARS]; /* epsilon: QKV's and gate/up's norms */
    _Atomic int64_t threads;       /* how many threads the node's last run had */
} layer_kernel;

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

static OrtStatus *layer_compute(void *state, OrtKernelContext *ctx) {
    layer_kernel *kernel = state;
    const char *op = "DecoderLayer";
    tensor t[L_NUM_IN];
    for (size_t i = 0; i < L_NUM_IN; i++)
        TRY(input(ctx, i, &t[i]));
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

/* -- the ops' descriptions --------------------------------------------------------------------- */

/* An attribute's value, or `fallback` when the node does not set it. */
static void read_int(const OrtKernelInfo *info, const char *name, int64_t fallback, int64_t *out) {
    OrtStatus *status = CALL(ORT_KernelInfoGetAttribute_int64, ort_attr_int_fn, info, name, out);
    if (status != NULL) {
        CALL(ORT_ReleaseStatus, ort_release_status_fn, status);
        *out = fallback;
    }
}

static void read_float(const OrtKernelInfo *info, const char *name, float fallback, float *out) {
    OrtStatus *status = CALL(ORT_KernelInfoGetAttribute_float, ort_attr_float_fn, info, name, out);
    if (status != NULL) {
        CALL(ORT_ReleaseStatus, ort_release_status_fn, status);
        *out = fallback;
    }
}

/* A kernel's state, `bytes` zeroed then read from the node's attributes by `read`, which returns
 * NULL or what is wrong with them. */
typedef const char *(*read_fn)(const OrtKernelInfo *info, void *kernel);
static OrtStatus *new_kernel(const char *op, size_t bytes, read_fn read, const OrtKernelInfo *info, void **out) {
    void *kernel = calloc(1, bytes);
    if (kernel == NULL)
        return error(op, "out of memory");
    const char *problem = read(info, kernel);
    if (problem != NULL) {
        free(kernel);
        return error(op, problem);
    }
    *out = kernel;
    return NULL;
}

static const char *read_attention(const OrtKernelInfo *info, void *kernel) {
    attention_kernel *k = kernel;
    read_int(info, "num_heads", 0, &k->num_heads);
    read_int(info, "num_kv_heads", 0, &k->num_kv_heads);
    read_int(info, "sliding_window", 0, &k->sliding_window);
    read_int(info, "rotary_interleaved", 0, &k->interleaved);
    read_float(info, "scale", 1.0f, &k->scale);
    read_float(info, "softcap", 0.0f, &k->softcap);
    read_float(info, "qk_norm_epsilon", 1e-6f, &k->qk_norm_epsilon);
    return k->num_heads <= 0 || k->num_kv_heads <= 0 ? "num_heads and num_kv_heads attributes must be positive" : NULL;
}

static OrtStatus *attention_create(const OrtCustomOp *op, const OrtApi *ort, const OrtKernelInfo *info,
                                   void **kernel_out) {
    (void)op;
    (void)ort;
    return new_kernel("PagedAttention", sizeof(attention_kernel), read_attention, info, kernel_out);
}

/* NULL, or why an mxfp4 weight's attributes are wrong: its blocks are always 32 k, symmetric. */
static const char *mxfp4_problem(int64_t format, int64_t block_size, int64_t zero_points) {
    return format == LLMC_FORMAT_MXFP4 && (block_size != 32 || zero_points != 0)
               ? "weight_format 6 (mxfp4) needs block_size 32 and zero_points 0" : NULL;
}

/* NULL, or what is wrong with a gated MLP's `activation` attribute (SwiGLU, SwiGLUMatMul). */
static const char *activation_problem(int64_t activation) {
    return activation != LLMC_ACT_SILU && activation != LLMC_ACT_GELU_TANH
               ? "attribute activation must be 0 (SiLU) or 1 (GELU, tanh approximation)" : NULL;
}

static const char *read_swiglu(const OrtKernelInfo *info, void *kernel) {
    int64_t *activation = kernel;
    read_int(info, "activation", LLMC_ACT_SILU, activation);
    return activation_problem(*activation);
}

static OrtStatus *swiglu_create(const OrtCustomOp *op, const OrtApi *ort, const OrtKernelInfo *info,
                                void **kernel_out) {
    (void)op;
    (void)ort;
    return new_kernel("SwiGLU", sizeof(int64_t), read_swiglu, info, kernel_out);
}

static const char *read_experts(const OrtKernelInfo *info, void *kernel) {
    experts_kernel *k = kernel;
    read_int(info, "activation", LLMC_ACT_SILU, &k->activation);
    read_int(info, "packed", 0, &k->packed);
    read_int(info, "weight_format", LLMC_FORMAT_FP32, &k->format);
    read_int(info, "block_size", 0, &k->block_size);
    read_int(info, "zero_points", 0, &k->zero_points);
    read_float(info, "alpha", 0.0f, &k->alpha);
    read_float(info, "limit", 0.0f, &k->limit);
    if (k->packed != 0 && k->packed != 1)
        return "attribute packed must be 0 (weights as the checkpoint holds them) or 1 (panels)";
    if (k->format != LLMC_FORMAT_FP32 && (!llmc_format_bits(k->format) || !k->packed))
        return "attribute weight_format must be 0 (fp32) or a quantized format (3, 4, 5, 6) with packed 1";
    if (llmc_format_bits(k->format) && k->block_size != 32 && k->block_size != 64 && k->block_size != 128)
        return "attribute block_size must be 32, 64 or 128";
    const char *mxfp4 = mxfp4_problem(k->format, k->block_size, k->zero_points);
    if (mxfp4 != NULL)
        return mxfp4;
    if (k->activation == LLMC_ACT_CLAMPED_SWIGLU)
        return k->limit > 0.0f ? NULL : "attribute limit (the clamped SwiGLU's) must be above 0";
    return activation_problem(k->activation);
}

static OrtStatus *experts_create(const OrtCustomOp *op, const OrtApi *ort, const OrtKernelInfo *info,
                                 void **kernel_out) {
    (void)op;
    (void)ort;
    return new_kernel("Experts", sizeof(experts_kernel), read_experts, info, kernel_out);
}

/* A packed GEMM's attributes, each name after `prefix` (DecoderLayer's four GEMMs have one each);
 * NULL or what is wrong with them. */
static const char *read_linear(const OrtKernelInfo *info, const char *prefix, linear_kernel *k) {
    static const char *const names[] = {"n", "weight_format", "block_size", "zero_points", "epsilon", "activation"};
    char name[6][48];
    for (int i = 0; i < 6; i++)
        snprintf(name[i], sizeof name[i], "%s%s", prefix, names[i]);
    read_int(info, name[0], 0, &k->n);
    read_int(info, name[1], LLMC_FORMAT_FP32, &k->format);
    read_int(info, name[2], 0, &k->block_size);
    read_int(info, name[3], 0, &k->zero_points);
    read_float(info, name[4], 1e-6f, &k->epsilon);
    read_int(info, name[5], LLMC_ACT_SILU, &k->activation);
    if (activation_problem(k->activation) != NULL)
        return activation_problem(k->activation);
    if (k->n <= 0)
        return "attribute n (output columns) must be positive";
    if (k->format < LLMC_FORMAT_FP32 || k->format > LLMC_FORMAT_MXFP4)
        return "attribute weight_format must be 0 (fp32), 1 (bf16), 2 (fp16), 3 (int8), 4 (int4), 5 (int6) or "
               "6 (mxfp4)";
    if (llmc_format_bits(k->format) && ((k->block_size != 32 && k->block_size != 64 && k->block_size != 128) ||
                                        (k->zero_points != 0 && k->zero_points != 1)))
        return "quantized weights need block_size 32, 64 or 128 and zero_points 0 or 1";
    return mxfp4_problem(k->format, k->block_size, k->zero_points);
}

static const char *read_gemm(const OrtKernelInfo *info, void *kernel) { return read_linear(info, "", kernel); }

static OrtStatus *linear_create(const OrtCustomOp *op, const OrtApi *ort, const OrtKernelInfo *info,
                                void **kernel_out) {
    (void)op;
    (void)ort;
    return new_kernel("PackedMatMul", sizeof(linear_kernel), read_gemm, info, kernel_out);
}

static const char *read_layer(const OrtKernelInfo *info, void *kernel) {
    layer_kernel *k = kernel;
    const char *problem = read_attention(info, &k->attention);
    for (int i = 0; i < LINEARS && problem == NULL; i++)
        problem = read_linear(info, linear_prefix[i], &k->linear[i]);
    return problem;
}

static OrtStatus *layer_create(const OrtCustomOp *op, const OrtApi *ort, const OrtKernelInfo *info,
                               void **kernel_out) {
    (void)op;
    (void)ort;
    return new_kernel("DecoderLayer", sizeof(layer_kernel), read_layer, info, kernel_out);
}

static void destroy(void *kernel) { free(kernel); }
static const char *cpu_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int32_t float_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return ORT_FLOAT; }
static int32_t mem_default(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static int no_variadic(const OrtCustomOp *op) { (void)op; return 0; }
static int start_version(const OrtCustomOp *op) { (void)op; return 1; }
static int end_version(const OrtCustomOp *op) { (void)op; return 2147483647; }
static int32_t required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return ORT_REQUIRED; }

/* The pool (input IN_CACHE, output 1) takes any type: ORT gives output 1 the input's type. */
static int32_t attention_input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    if (i == IN_CACHE)
        return ORT_UNDEFINED;
    return (i == IN_PAST || i == IN_QLEN || i == IN_TABLES) ? ORT_INT32 : i == IN_POS ? ORT_INT64 : ORT_FLOAT;
}
static int32_t attention_output_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 1 ? ORT_UNDEFINED : ORT_FLOAT;
}
static int32_t attention_input_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    return (i == IN_K || i == IN_V || i >= IN_COS) ? ORT_OPTIONAL : ORT_REQUIRED;
}


/* DecoderLayer: the weights take any type (as a GEMM's), the pool too; the lossless copies uint8. */
static int32_t layer_input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    if (i == L_W_QKV || i == L_W_O || i == L_W_GATE_UP || i == L_W_DOWN || i == L_CACHE)
        return ORT_UNDEFINED;
    if (i >= L_LOSSLESS && i < L_Q_NORM)
        return ORT_UINT8;
    return (i == L_PAST || i == L_QLEN || i == L_TABLES) ? ORT_INT32 : i == L_POS ? ORT_INT64 : ORT_FLOAT;
}
static int32_t layer_input_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    return (i == L_COS || i == L_SIN || i == L_POS || i >= L_QKV_BIAS) ? ORT_OPTIONAL : ORT_REQUIRED;
}
static int32_t layer_output_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 2 ? ORT_UNDEFINED : ORT_FLOAT;
}

/* An op with more than one input of any type (DecoderLayer's weights and pool) must say its
 * outputs' types itself: the rows have x's type and shape, the pool its input's. */
static OrtStatus *layer_infer(const OrtCustomOp *op, OrtShapeInferContext *ctx) {
    (void)op;
    static const size_t from[3] = {L_X, L_X, L_CACHE};
    for (size_t i = 0; i < 3; i++) {
        OrtTensorTypeAndShapeInfo *info;
        TRY(CALL(ORT_ShapeInferContext_GetInputTypeShape, ort_infer_input_fn, ctx, from[i], &info));
        TRY(CALL(ORT_ShapeInferContext_SetOutputTypeShape, ort_infer_output_fn, ctx, i, info));
    }
    return NULL;
}

/* ORT asks an op for its name and input/output counts through callbacks taking the op itself, so
 * the values live in a struct that starts with the OrtCustomOp. */
typedef struct {
    OrtCustomOp op;
    const char *name;
    size_t inputs, outputs;
    size_t lossless; /* a GEMM op's optional last input, the weight's lossless copy */
} op_description;

/* The weight (the input before the lossless copy) takes any type: float32 panels, uint16 panels or
 * a uint8 blob by the node's weight_format; check_packed checks it. */
static int32_t linear_input_type(const OrtCustomOp *op, size_t i) {
    size_t lossless = ((const op_description *)op)->lossless;
    return i == lossless ? ORT_UINT8 : (i + 1 == lossless ? ORT_UNDEFINED : ORT_FLOAT);
}
static int32_t linear_input_kind(const OrtCustomOp *op, size_t i) {
    return i == ((const op_description *)op)->lossless ? ORT_OPTIONAL : ORT_REQUIRED;
}

/* PackedMatMul's optional second output: each row's argmax. */
static int32_t linear_output_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 1 ? ORT_INT64 : ORT_FLOAT; }
static int32_t linear_output_kind(const OrtCustomOp *op, size_t i) { (void)op; return i == 1 ? ORT_OPTIONAL : ORT_REQUIRED; }

static const char *op_name(const OrtCustomOp *op) { return ((const op_description *)op)->name; }
static size_t op_inputs(const OrtCustomOp *op) { return ((const op_description *)op)->inputs; }
static size_t op_outputs(const OrtCustomOp *op) { return ((const op_description *)op)->outputs; }

typedef OrtStatus *(*create_fn)(const OrtCustomOp *, const OrtApi *, const OrtKernelInfo *, void **);
typedef OrtStatus *(*compute_fn)(void *, OrtKernelContext *);

static void define(op_description *d, const char *name, create_fn create, compute_fn compute, size_t inputs,
                   size_t outputs, int32_t (*input_type)(const OrtCustomOp *, size_t),
                   int32_t (*input_kind)(const OrtCustomOp *, size_t)) {
    OrtCustomOp *op = &d->op;
    memset(d, 0, sizeof *d);
    d->name = name;
    d->inputs = inputs;
    d->outputs = outputs;
    op->version = LLMC_ORT_OP_VERSION;
    op->CreateKernelV2 = create;
    op->KernelComputeV2 = compute;
    op->GetName = op_name;
    op->GetExecutionProviderType = cpu_provider;
    op->GetInputType = input_type;
    op->GetInputTypeCount = op_inputs;
    op->GetOutputType = float_type;
    op->GetOutputTypeCount = op_outputs;
    op->KernelDestroy = destroy;
    op->GetInputCharacteristic = input_kind;
    op->GetOutputCharacteristic = required;
    op->GetInputMemoryType = mem_default;
    op->GetVariadicInputMinArity = no_variadic;
    op->GetVariadicInputHomogeneity = no_variadic;
    op->GetVariadicOutputMinArity = no_variadic;
    op->GetVariadicOutputHomogeneity = no_variadic;
    op->GetStartVersion = start_version;
    op->GetEndVersion = end_version;
}

/* Experts' input 1, the chosen ids, is int64; the weights (3, 4) float32 or uint8 blobs; the rest
 * float32, the biases (5, 6) optional. */
static int32_t experts_input_type(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i == 1 ? ORT_INT64 : i == 3 || i == 4 ? ORT_UNDEFINED : ORT_FLOAT;
}
static int32_t experts_input_kind(const OrtCustomOp *op, size_t i) {
    (void)op;
    return i >= 5 ? ORT_OPTIONAL : ORT_REQUIRED;
}

static op_description attention_op, swiglu_op, linear_op, norm_linear_op, swiglu_linear_op, layer_op, experts_op;

EXPORT OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    api = base->GetApi(LLMC_ORT_API_SHAPE_REF);
    shape_by_reference = api != NULL;
    if (api == NULL)
        api = base->GetApi(LLMC_ORT_API_VERSION);
    if (api == NULL)
        return NULL;  /* an ORT older than the kernels need: ORT reports the unknown ops */
    /* Once per process: sessions already running read these descriptions at compute time, so a
     * later registration (another engine) must not rewrite them under them. */
    if (attention_op.name == NULL) {
        define(&attention_op, "PagedAttention", attention_create, attention_compute, NUM_IN, 2,
               attention_input_type, attention_input_kind);
        attention_op.op.GetOutputType = attention_output_type;
        define(&swiglu_op, "SwiGLU", swiglu_create, swiglu_compute, 1, 1, float_type, required);
        define(&linear_op, "PackedMatMul", linear_create, linear_compute, 3, 2, linear_input_type,
               linear_input_kind);
        linear_op.op.GetOutputType = linear_output_type;
        linear_op.op.GetOutputCharacteristic = linear_output_kind;
        define(&norm_linear_op, "SkipRMSNormMatMul", linear_create, norm_linear_compute, 5, 2, linear_input_type,
               linear_input_kind);
        define(&swiglu_linear_op, "SwiGLUMatMul", linear_create, swiglu_linear_compute, 3, 1, linear_input_type,
               linear_input_kind);
        linear_op.lossless = swiglu_linear_op.lossless = 2;
        norm_linear_op.lossless = 4;
        define(&layer_op, "DecoderLayer", layer_create, layer_compute, L_NUM_IN, 3, layer_input_type,
               layer_input_kind);
        layer_op.op.GetOutputType = layer_output_type;
        layer_op.op.InferOutputShapeFn = layer_infer;
        define(&experts_op, "Experts", experts_create, experts_compute, 7, 1, experts_input_type, experts_input_kind);
    }

    OrtCustomOpDomain *domain;
    TRY(CALL(ORT_CreateCustomOpDomain, ort_create_domain_fn, "llmc.cpu", &domain));
    TRY(CALL(ORT_CustomOpDomain_Add, ort_domain_add_fn, domain, &attention_op.op));
    TRY(CALL(ORT_CustomOpDomain_Add, ort_domain_add_fn, domain, &swiglu_op.op));
    TRY(CALL(ORT_CustomOpDomain_Add, ort_domain_add_fn, domain, &linear_op.op));
    TRY(CALL(ORT_CustomOpDomain_Add, ort_domain_add_fn, domain, &norm_linear_op.op));
    TRY(CALL(ORT_CustomOpDomain_Add, ort_domain_add_fn, domain, &swiglu_linear_op.op));
    TRY(CALL(ORT_CustomOpDomain_Add, ort_domain_add_fn, domain, &layer_op.op));
    TRY(CALL(ORT_CustomOpDomain_Add, ort_domain_add_fn, domain, &experts_op.op));
    return CALL(ORT_AddCustomOpDomain, ort_add_domain_fn, options, domain);
}
