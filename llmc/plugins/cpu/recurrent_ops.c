/* The recurrent layers' ops, CausalConv1d and GatedDeltaRule (kernels.h, "recurrent layers"):
 * each checks its node's inputs, binds its pool output to the pool input and runs the kernels'
 * tasks (recurrent.c) on ORT's intra-op threads. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "ops.h"
#include "ort_glue.h"

/* The product of t's dims past the first two (the [batch, seq] every token input leads with). */
static int64_t per_token(const tensor *t) {
    int64_t count = 1;
    for (size_t i = 2; i < t->rank; i++)
        count *= t->dims[i];
    return count;
}

/* Whether t is float32 [batch, seq, ...] with `count` elements per token, at least `rank` dims. */
static int token_input(const tensor *t, size_t rank, int64_t batch, int64_t seq, int64_t count) {
    return t->value != NULL && t->type == ORT_FLOAT && t->rank >= rank && t->dims[0] == batch && t->dims[1] == seq &&
           per_token(t) == count;
}

/* The rows' lengths and slots (inputs `first` .. first + 2), which come with the pool and only
 * with it, checked against the pool's slots. */
static OrtStatus *rows_setup(OrtKernelContext *ctx, const char *op, const tensor *pool, size_t first,
                             llmc_recurrent_rows *r) {
    tensor meta[3];
    for (size_t i = 0; i < 3; i++)
        TRY(input(ctx, first + i, &meta[i]));
    if (pool->value == NULL) {
        if (meta[0].value != NULL || meta[1].value != NULL || meta[2].value != NULL)
            return error(op, "past_lens, query_lens and state_slots come with the state input, not without it");
        return NULL;
    }
    for (size_t i = 0; i < 3; i++)
        if (meta[i].value == NULL || meta[i].type != ORT_INT32 || meta[i].rank != 1 || meta[i].dims[0] != r->batch)
            return error(op, "with a state input, past_lens, query_lens and state_slots must be int32 [batch]");
    r->slots = pool->dims[0];
    TRY(data(meta[0].value, (void **)&r->past_lens));
    TRY(data(meta[1].value, (void **)&r->query_lens));
    TRY(data(meta[2].value, (void **)&r->state_slots));
    const char *problem = llmc_recurrent_check(r);
    return problem != NULL ? error(op, problem) : NULL;
}

/* The pool output (output 1), aliased to the pool input by the runtime's binding; where it is
 * not (a plain session.run), the pool is carried over first. */
static OrtStatus *pool_output(OrtKernelContext *ctx, const char *op, const tensor *pool, float **out) {
    size_t outputs;
    TRY(CALL(ORT_KernelContext_GetOutputCount, ort_get_count_fn, ctx, &outputs));
    if (outputs < 2)
        return error(op, "a state input needs output 1, state_out (bound to the same buffer)");
    void *in;
    TRY(data(pool->value, &in));
    TRY(output(ctx, 1, pool->dims, pool->rank, (void **)out));
    size_t elements = 1;
    for (size_t i = 0; i < pool->rank; i++)
        elements *= (size_t)pool->dims[i];
    if (*out != in && elements > 0)
        memcpy(*out, in, elements * sizeof(float));
    return NULL;
}

/* -- CausalConv1d ------------------------------------------------------------------------------ */

static void conv_one(void *arg, size_t task) { llmc_conv_task((const llmc_conv *)arg, (int64_t)task); }

static OrtStatus *conv_shapes(const char *op, const tensor t[CONV_NUM_IN], llmc_conv *c) {
    const tensor *x = &t[CONV_X], *w = &t[CONV_WEIGHT], *bias = &t[CONV_BIAS], *pool = &t[CONV_STATE];
    if (x->type != ORT_FLOAT || x->rank != 3)
        return error(op, "x must be float32 [batch, seq, channels]");
    c->rows.batch = x->dims[0];
    c->rows.seq = x->dims[1];
    c->channels = x->dims[2];
    if (w->type != ORT_FLOAT || w->rank != 2 || w->dims[0] != c->channels || w->dims[1] < 1 ||
        w->dims[1] > LLMC_CONV_MAX_WIDTH)
        return error(op, "weight must be float32 [channels, width] with x's channels and width 1 to 16");
    c->width = w->dims[1];
    if (bias->value != NULL && (bias->type != ORT_FLOAT || bias->rank != 1 || bias->dims[0] != c->channels))
        return error(op, "bias must be float32 [channels]");
    if (pool->value != NULL && (pool->type != ORT_FLOAT || pool->rank != 3 || pool->dims[1] != c->width - 1 ||
                                pool->dims[2] != c->channels))
        return error(op, "state must be float32 [slots, width - 1, channels]");
    return NULL;
}

OrtStatus *conv_compute(void *state, OrtKernelContext *ctx) {
    const char *op = "CausalConv1d";
    tensor t[CONV_NUM_IN];
    TRY(inputs(ctx, t, CONV_NUM_IN));
    llmc_conv c = {.activation = (int)*(const int64_t *)state};
    TRY(conv_shapes(op, t, &c));
    TRY(rows_setup(ctx, op, &t[CONV_STATE], CONV_PAST, &c.rows));
    TRY(data(t[CONV_X].value, (void **)&c.x));
    TRY(data(t[CONV_WEIGHT].value, (void **)&c.weight));
    if (t[CONV_BIAS].value != NULL)
        TRY(data(t[CONV_BIAS].value, (void **)&c.bias));
    TRY(output(ctx, 0, t[CONV_X].dims, 3, (void **)&c.y));
    if (t[CONV_STATE].value != NULL)
        TRY(pool_output(ctx, op, &t[CONV_STATE], &c.state));
    int64_t tasks = llmc_conv_tasks(&c);
    return tasks > 0 && c.rows.seq > 0 ? parallel(ctx, conv_one, (size_t)tasks, &c) : NULL;
}

/* -- GatedDeltaRule ---------------------------------------------------------------------------- */

static void delta_one(void *arg, size_t task) { llmc_delta_task((const llmc_delta *)arg, (int64_t)task); }

static OrtStatus *delta_shapes(const char *op, const delta_kernel *k, const tensor t[DELTA_NUM_IN], llmc_delta *d) {
    const tensor *q = &t[DELTA_Q], *pool = &t[DELTA_STATE];
    if (q->type != ORT_FLOAT || q->rank < 3)
        return error(op, "q must be float32 [batch, seq, num_k_heads, k_head_dim] or [batch, seq, num_k_heads * "
                         "k_head_dim]");
    int64_t batch = q->dims[0], seq = q->dims[1], qk = k->num_k_heads * k->k_head_dim;
    if (!token_input(q, 3, batch, seq, qk) || !token_input(&t[DELTA_K], 3, batch, seq, qk))
        return error(op, "q and k must be float32 [batch, seq, num_k_heads, k_head_dim] (or the heads flattened)");
    if (!token_input(&t[DELTA_V], 3, batch, seq, k->num_v_heads * k->v_head_dim))
        return error(op, "v must be float32 [batch, seq, num_v_heads, v_head_dim] (or the heads flattened) with q's "
                         "batch and seq");
    if (!token_input(&t[DELTA_G], 2, batch, seq, k->num_v_heads) ||
        !token_input(&t[DELTA_BETA], 2, batch, seq, k->num_v_heads))
        return error(op, "g and beta must be float32 [batch, seq, num_v_heads]");
    if (pool->value != NULL && (pool->type != ORT_FLOAT || pool->rank != 4 || pool->dims[1] != k->num_v_heads ||
                                pool->dims[2] != k->k_head_dim || pool->dims[3] != k->v_head_dim))
        return error(op, "state must be float32 [slots, num_v_heads, k_head_dim, v_head_dim]");
    d->rows.batch = batch;
    d->rows.seq = seq;
    d->num_k_heads = k->num_k_heads;
    d->num_v_heads = k->num_v_heads;
    d->k_dim = k->k_head_dim;
    d->v_dim = k->v_head_dim;
    return NULL;
}

OrtStatus *delta_compute(void *state, OrtKernelContext *ctx) {
    const char *op = "GatedDeltaRule";
    tensor t[DELTA_NUM_IN];
    TRY(inputs(ctx, t, DELTA_NUM_IN));
    llmc_delta d = {0};
    TRY(delta_shapes(op, state, t, &d));
    TRY(rows_setup(ctx, op, &t[DELTA_STATE], DELTA_PAST, &d.rows));
    const float **inputs[5] = {&d.q, &d.k, &d.v, &d.g, &d.beta};
    for (size_t i = 0; i < 5; i++)
        TRY(data(t[DELTA_Q + i].value, (void **)inputs[i]));
    int64_t dims[4] = {d.rows.batch, d.rows.seq, d.num_v_heads, d.v_dim};
    TRY(output(ctx, 0, dims, 4, (void **)&d.out));
    float *scratch = NULL;
    if (t[DELTA_STATE].value != NULL) {
        TRY(pool_output(ctx, op, &t[DELTA_STATE], &d.state));
    } else {  /* no pool: the rows' states start from zeros and are dropped */
        scratch = malloc((size_t)(d.rows.batch * d.num_v_heads * d.k_dim * d.v_dim) * sizeof(float) + 64);
        if (scratch == NULL)
            return error(op, "out of memory for the recurrent states");
        d.state = scratch;
    }
    int64_t tasks = llmc_delta_tasks(&d);
    OrtStatus *status = tasks > 0 && d.rows.seq > 0 ? parallel(ctx, delta_one, (size_t)tasks, &d) : NULL;
    free(scratch);
    return status;
}
