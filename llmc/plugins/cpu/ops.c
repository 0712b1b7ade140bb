/* The single ops' compute: PagedAttention, SwiGLU, Experts, PackedMatMul (optionally with each
 * row's argmax), SkipRMSNormMatMul and SwiGLUMatMul. Each checks its node's inputs, binds them to
 * the kernels (kernels.h) and runs the kernels' tasks on ORT's intra-op threads. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "ops.h"
#include "ort_glue.h"

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

/* -- PagedAttention -------------------------------------------------------------------------- */

static void attend_one(void *arg, size_t task) { llmc_attention_task((const llmc_attention *)arg, (int64_t)task); }

OrtStatus *attention_setup(const char *op, const attention_kernel *kernel, const tensor t[NUM_IN],
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

OrtStatus *attention_pool(OrtKernelContext *ctx, const tensor *cache, size_t index, llmc_attention *a) {
    void *cache_in;
    TRY(data(cache->value, &cache_in));
    TRY(output(ctx, index, cache->dims, cache->rank, &a->cache));
    if (a->cache != cache_in)
        memcpy(a->cache, cache_in, (size_t)(2 * a->num_blocks * a->num_kv_heads * llmc_attention_tile_bytes(a)));
    return NULL;
}

OrtStatus *attention_compute(void *state, OrtKernelContext *ctx) {
    const char *op = "PagedAttention";
    tensor t[NUM_IN];
    TRY(inputs(ctx, t, NUM_IN));
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

OrtStatus *swiglu_compute(void *state, OrtKernelContext *ctx) {
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

OrtStatus *experts_compute(void *state, OrtKernelContext *ctx) {
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

/* A quantized format's name, for messages. */
static const char *quant_name(int format) {
    return format == LLMC_FORMAT_MXFP4 ? "mxfp4" : format == LLMC_FORMAT_INT8 ? "int8"
                                                  : format == LLMC_FORMAT_INT6 ? "int6" : "int4";
}

OrtStatus *check_packed(const char *op, const linear_kernel *kernel, const tensor *x, const tensor *w, int64_t *k) {
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

static void linear_one(void *arg, size_t panel) {
    const linear_job *job = arg;
    linear_panel(job, (int64_t)panel);
    if (job->best != NULL)
        panel_argmax(job, (int64_t)panel);
}

OrtStatus *lossless_input(OrtKernelContext *ctx, const char *op, size_t index, linear_job *job) {
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

OrtStatus *weight_data(const linear_kernel *kernel, const tensor *w, linear_job *job) {
    job->format = (int)kernel->format;
    job->zero_points = (int)kernel->zero_points;
    if (kernel->format == LLMC_FORMAT_FP32)
        return data(w->value, (void **)&job->w);
    return data(w->value, (void **)&job->packed);
}

OrtStatus *linear_compute(void *state, OrtKernelContext *ctx) {
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

OrtStatus *norm_linear_compute(void *state, OrtKernelContext *ctx) {
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

OrtStatus *swiglu_linear_compute(void *state, OrtKernelContext *ctx) {
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
