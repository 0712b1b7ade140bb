/* See kernels.h, "recurrent layers". Both ops update their slot of the pool in place, so a task
 * reads everything of the old state it still needs before it writes: the convolution copies its
 * window out first, the delta rule owns its (slot, head) state outright. Rows' slots are distinct
 * (llmc_recurrent_check), so no two tasks touch one state. */
#include "kernels.h"
#include "simd.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

const char *llmc_recurrent_check(const llmc_recurrent_rows *r) {
    static _Thread_local char message[200];
    if (r->state_slots == NULL)
        return NULL;
    for (int64_t b = 0; b < r->batch; b++) {
        long long slot = r->state_slots[b], past = r->past_lens[b], n = r->query_lens[b];
        if (n < 0 || n > r->seq)
            snprintf(message, sizeof message, "query_lens[%lld] is %lld, outside [0, %lld] (the step's tokens)",
                     (long long)b, n, (long long)r->seq);
        else if (past < 0)
            snprintf(message, sizeof message, "past_lens[%lld] is %lld, below 0", (long long)b, past);
        else if (slot < 0 || slot >= r->slots)
            snprintf(message, sizeof message, "state_slots[%lld] is %lld, outside the pool's %lld slots",
                     (long long)b, slot, (long long)r->slots);
        else {
            for (int64_t a = 0; a < b; a++)
                if (r->state_slots[a] == slot) {
                    snprintf(message, sizeof message, "rows %lld and %lld both name state slot %lld",
                             (long long)a, (long long)b, slot);
                    return message;
                }
            continue;
        }
        return message;
    }
    return NULL;
}

/* Row b's valid tokens, and whether it continues its slot's state (else it starts from zeros). */
static inline int64_t valid_tokens(const llmc_recurrent_rows *r, int64_t b) {
    return r->state_slots != NULL ? r->query_lens[b] : r->seq;
}
static inline int resumes(const llmc_recurrent_rows *r, int64_t b) {
    return r->state_slots != NULL && r->past_lens[b] > 0;
}

/* -- CausalConv1d ------------------------------------------------------------------------------ */

static inline int64_t conv_blocks(const llmc_conv *c) { return (c->channels + LLMC_CONV_BLOCK - 1) / LLMC_CONV_BLOCK; }

int64_t llmc_conv_tasks(const llmc_conv *c) { return c->rows.batch * conv_blocks(c); }

/* Output row t of one block of w channels: act(bias + sum_j wt[j] * in[t + j]), in's rows before
 * the step's first token taken from the window. */
static inline void conv_token(const llmc_conv *c, const float (*wt)[LLMC_CONV_BLOCK], const float *bias,
                              const float (*window)[LLMC_CONV_BLOCK], const float *x, float *y, int64_t t,
                              int64_t w) {
    const int64_t history = c->width - 1, stride = c->channels;
    float acc[LLMC_CONV_BLOCK];
    memcpy(acc, bias, (size_t)w * sizeof(float));
    for (int64_t j = 0; j < c->width; j++) {
        const float *in = t + j < history ? window[t + j] : x + (t + j - history) * stride;
#pragma omp simd
        for (int64_t i = 0; i < w; i++)
            acc[i] += wt[j][i] * in[i];
    }
    if (c->activation == LLMC_CONV_ACT_SILU) {
#pragma omp simd
        for (int64_t i = 0; i < w; i++)
            y[i] = acc[i] / (1.0f + exp_f(-acc[i]));
    } else {
        memcpy(y, acc, (size_t)w * sizeof(float));
    }
}

/* wt[j][i] = weight[i, j] for w channels of K taps. A decode step reads each weight once, so this
 * costs as much as the convolution: with K constant (the models' 3 and 4) it vectorizes. */
static inline __attribute__((always_inline)) void transpose(const float *restrict weight,
                                                            float (*restrict wt)[LLMC_CONV_BLOCK], int64_t w,
                                                            const int64_t K) {
    for (int64_t i = 0; i < w; i++)
        for (int64_t j = 0; j < K; j++)
            wt[j][i] = weight[i * K + j];
}

LLMC_CLONES
void llmc_conv_task(const llmc_conv *c, int64_t task) {
    const llmc_recurrent_rows *r = &c->rows;
    const int64_t C = c->channels, K = c->width, history = K - 1, S = r->seq;
    const int64_t b = task / conv_blocks(c), c0 = task % conv_blocks(c) * LLMC_CONV_BLOCK;
    const int64_t w = C - c0 < LLMC_CONV_BLOCK ? C - c0 : LLMC_CONV_BLOCK, n = valid_tokens(r, b);
    /* The weight is [C, K]: transposed here, each tap's weights run along the channels as x does. */
    float wt[LLMC_CONV_MAX_WIDTH][LLMC_CONV_BLOCK], bias[LLMC_CONV_BLOCK];
    float window[LLMC_CONV_MAX_WIDTH - 1][LLMC_CONV_BLOCK];
    const float *weight = c->weight + c0 * K;
    if (K == 4)
        transpose(weight, wt, w, 4);
    else if (K == 3)
        transpose(weight, wt, w, 3);
    else
        transpose(weight, wt, w, K);
    for (int64_t i = 0; i < w; i++)
        bias[i] = c->bias != NULL ? c->bias[c0 + i] : 0.0f;
    float *slot = c->state != NULL ? c->state + (int64_t)r->state_slots[b] * history * C + c0 : NULL;
    for (int64_t j = 0; j < history; j++) {
        if (resumes(r, b))
            memcpy(window[j], slot + j * C, (size_t)w * sizeof(float));
        else
            memset(window[j], 0, (size_t)w * sizeof(float));
    }
    const float *x = c->x + b * S * C + c0;
    float *y = c->y + b * S * C + c0;
    for (int64_t t = 0; t < n; t++)
        conv_token(c, (const float (*)[LLMC_CONV_BLOCK])wt, bias, (const float (*)[LLMC_CONV_BLOCK])window, x,
                   y + t * C, t, w);
    for (int64_t t = n; t < S; t++)
        memset(y + t * C, 0, (size_t)w * sizeof(float));
    /* The slot keeps in's last K - 1 rows, from the window copy where n < K - 1. */
    for (int64_t j = 0; slot != NULL && j < history; j++) {
        const float *src = n + j < history ? window[n + j] : x + (n + j - history) * C;
        memcpy(slot + j * C, src, (size_t)w * sizeof(float));
    }
}

/* -- GatedDeltaRule ---------------------------------------------------------------------------- */

int64_t llmc_delta_tasks(const llmc_delta *d) { return d->rows.batch * d->num_v_heads; }

/* out = x * scale / sqrt(sum x^2 + 1e-6): the kernel's q/k L2 norm (FLA's epsilon). */
INLINE void l2_normalize(const float *x, float *out, int64_t n, float scale) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++)
        sum += x[i] * x[i];
    float factor = scale / sqrtf(sum + 1e-6f);
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        out[i] = x[i] * factor;
}

/* The state passes run along dv: each row of S is dv contiguous floats. Where dv is a multiple of
 * 16, a pass takes 64 columns at a time and keeps their sums (and delta) in registers over the dk
 * rows, so S's elements are its only loads and stores; elsewhere plain loops over whole rows. The
 * passes are always inlined (INLINE) into llmc_delta_task, so they take its clone's vector width. */

/* f(..., V) for the column blocks of a dv-wide row, dv a multiple of 16: blocks of 4 vectors, then
 * the rest. */
#define COLUMN_BLOCKS(dv, f, ...)                                                                  \
    do {                                                                                           \
        int64_t j0_ = 0;                                                                           \
        for (; j0_ + 64 <= (dv); j0_ += 64)                                                        \
            f(__VA_ARGS__, j0_, 4);                                                                \
        switch (((dv) - j0_) / 16) {                                                               \
        case 3: f(__VA_ARGS__, j0_, 3); break;                                                     \
        case 2: f(__VA_ARGS__, j0_, 2); break;                                                     \
        case 1: f(__VA_ARGS__, j0_, 1); break;                                                     \
        default: break;                                                                            \
        }                                                                                          \
    } while (0)

/* kv[j0, j0 + 16 V) = k^T S over those columns; even and odd rows sum apart, two chains of FMAs
 * per vector rather than one. */
INLINE void read_columns(const float *state, const float *k, float *kv, int64_t dk, int64_t dv, int64_t j0,
                         const int V) {
    v16 m[2][4];
    for (int v = 0; v < V; v++)
        m[0][v] = m[1][v] = (v16){0};
    int64_t i = 0;
    for (; i + 2 <= dk; i += 2)
        for (int p = 0; p < 2; p++)
            for (int v = 0; v < V; v++)
                m[p][v] += k[i + p] * VLOAD(state + (i + p) * dv + j0 + 16 * v);
    for (; i < dk; i++)
        for (int v = 0; v < V; v++)
            m[0][v] += k[i] * VLOAD(state + i * dv + j0 + 16 * v);
    for (int v = 0; v < V; v++)
        VSTORE(kv + j0 + 16 * v, m[0][v] + m[1][v]);
}

/* kv = k^T S over the state's dk rows of dv. */
INLINE void read_state(const float *state, const float *k, float *kv, int64_t dk, int64_t dv) {
    if (dv % 16 == 0) {
        COLUMN_BLOCKS(dv, read_columns, state, k, kv, dk, dv);
        return;
    }
    memset(kv, 0, (size_t)dv * sizeof(float));
    for (int64_t i = 0; i < dk; i++) {
        const float *row = state + i * dv;
        const float ki = k[i];
#pragma omp simd
        for (int64_t j = 0; j < dv; j++)
            kv[j] += ki * row[j];
    }
}

/* One token's pass over columns [j0, j0 + 16 V) of the state (update_state). */
INLINE void update_columns(float *state, float decay, const float *k, const float *delta, const float *q,
                           float *out, const float *next, float *kv, int64_t dk, int64_t dv, int64_t j0,
                           const int V) {
    v16 d[4], o[4], m[4];
    for (int v = 0; v < V; v++) {
        d[v] = VLOAD(delta + j0 + 16 * v);
        o[v] = m[v] = (v16){0};
    }
    for (int64_t i = 0; i < dk; i++) {
        float *row = state + i * dv + j0;
        const float ki = k[i], qi = q[i], ni = next != NULL ? next[i] : 0.0f;
        for (int v = 0; v < V; v++) {
            v16 s = decay * VLOAD(row + 16 * v) + ki * d[v];
            VSTORE(row + 16 * v, s);
            o[v] += qi * s;
            if (next != NULL)
                m[v] += ni * s;
        }
    }
    for (int v = 0; v < V; v++) {
        VSTORE(out + j0 + 16 * v, o[v]);
        if (next != NULL)
            VSTORE(kv + j0 + 16 * v, m[v]);
    }
}

/* One token's pass over the state: S = decay S + k delta^T, out = q^T S, and, with a next key,
 * kv = next^T S for the next token. */
INLINE void update_state(float *state, float decay, const float *k, const float *delta, const float *q,
                                float *out, const float *next, float *kv, int64_t dk, int64_t dv) {
    if (dv % 16 == 0) {
        /* specialized on whether a next key rides along */
        if (next != NULL)
            COLUMN_BLOCKS(dv, update_columns, state, decay, k, delta, q, out, next, kv, dk, dv);
        else
            COLUMN_BLOCKS(dv, update_columns, state, decay, k, delta, q, out, NULL, kv, dk, dv);
        return;
    }
    memset(out, 0, (size_t)dv * sizeof(float));
    if (next != NULL)
        memset(kv, 0, (size_t)dv * sizeof(float));
    for (int64_t i = 0; i < dk; i++) {
        float *row = state + i * dv;
        const float ki = k[i], qi = q[i];
        if (next != NULL) {
            const float ni = next[i];
#pragma omp simd
            for (int64_t j = 0; j < dv; j++) {
                float s = decay * row[j] + ki * delta[j];
                row[j] = s;
                out[j] += qi * s;
                kv[j] += ni * s;
            }
        } else {
#pragma omp simd
            for (int64_t j = 0; j < dv; j++) {
                float s = decay * row[j] + ki * delta[j];
                row[j] = s;
                out[j] += qi * s;
            }
        }
    }
}

LLMC_CLONES
void llmc_delta_task(const llmc_delta *d, int64_t task) {
    const llmc_recurrent_rows *r = &d->rows;
    const int64_t Hk = d->num_k_heads, Hv = d->num_v_heads, dk = d->k_dim, dv = d->v_dim, S = r->seq;
    const int64_t b = task / Hv, h = task % Hv, kh = h / (Hv / Hk), n = valid_tokens(r, b);
    const int64_t slot = r->state_slots != NULL ? r->state_slots[b] : b;
    float *state = d->state + (slot * Hv + h) * dk * dv;
    float *out = d->out + (b * S * Hv + h) * dv;
    if (!resumes(r, b))
        memset(state, 0, (size_t)(dk * dv) * sizeof(float));
    for (int64_t t = n; t < S; t++)
        memset(out + t * Hv * dv, 0, (size_t)dv * sizeof(float));
    if (n == 0)
        return;
    float keys[2][LLMC_DELTA_MAX_DIM], q[LLMC_DELTA_MAX_DIM], kv[LLMC_DELTA_MAX_DIM], delta[LLMC_DELTA_MAX_DIM];
    const float scale = 1.0f / sqrtf((float)dk);
    const int64_t qk_token = Hk * dk, v_token = Hv * dv;
    const float *q_row = d->q + b * S * qk_token + kh * dk, *k_row = d->k + b * S * qk_token + kh * dk;
    const float *v_row = d->v + b * S * v_token + h * dv;
    const float *g = d->g + b * S * Hv + h, *beta = d->beta + b * S * Hv + h;
    l2_normalize(k_row, keys[0], dk, 1.0f);
    if (resumes(r, b))
        read_state(state, keys[0], kv, dk, dv);
    else  /* a zeroed state reads 0 */
        memset(kv, 0, (size_t)dv * sizeof(float));
    for (int64_t t = 0; t < n; t++) {
        const float decay = expf(g[t * Hv]), beta_t = beta[t * Hv];
        const float *v = v_row + t * v_token;
        /* kv holds k_t^T S before this token's decay, which scales it as it scales S. */
#pragma omp simd
        for (int64_t j = 0; j < dv; j++)
            delta[j] = (v[j] - decay * kv[j]) * beta_t;
        l2_normalize(q_row + t * qk_token, q, dk, scale);
        const float *next = NULL;
        if (t + 1 < n) {
            l2_normalize(k_row + (t + 1) * qk_token, keys[(t + 1) & 1], dk, 1.0f);
            next = keys[(t + 1) & 1];
        }
        update_state(state, decay, keys[t & 1], delta, q, out + t * v_token, next, kv, dk, dv);
    }
}
