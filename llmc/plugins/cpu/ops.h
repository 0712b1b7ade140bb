/* The ops' kernels (ops.c computes the single ops, decoder_layer.c DecoderLayer; ort_glue.c
 * describes them to ORT): each node's state, read from its attributes when ORT creates the
 * kernel, the ops' input indices, and what DecoderLayer reuses of the single ops. */
#ifndef LLMC_OPS_H
#define LLMC_OPS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "ort_glue.h"

/* -- PagedAttention -------------------------------------------------------------------------- */

enum {
    IN_Q, IN_K, IN_V, IN_CACHE, IN_PAST, IN_QLEN, IN_TABLES, IN_COS, IN_SIN, IN_POS, IN_Q_NORM, IN_K_NORM, IN_SINKS,
    NUM_IN
};

typedef struct {
    int64_t num_heads, num_kv_heads, sliding_window, interleaved;
    float scale, softcap, qk_norm_epsilon;
} attention_kernel;

/* Q, then K and V, in each token's row of a merged QKV projection. */
static inline void packed_qkv(llmc_attention *a, const float *qkv) {
    a->q = qkv;
    a->k = qkv + a->num_heads * a->head_dim;
    a->v = a->k + a->num_kv_heads * a->head_dim;
}

/* The step's attention from the op's inputs t (the query's shape from t[IN_Q], its data from
 * q_data, which a packed query may leave NULL for the caller's packed_qkv): everything but the
 * output, the pool to write and the key splits. */
OrtStatus *attention_setup(const char *op, const attention_kernel *kernel, const tensor t[NUM_IN],
                           const float *q_data, llmc_attention *out);

/* The pool output (output `index`), aliased to the pool input by the runtime's binding; where it
 * is not (a plain session.run), the pool is carried over first. */
OrtStatus *attention_pool(OrtKernelContext *ctx, const tensor *cache, size_t index, llmc_attention *a);

/* -- Experts ----------------------------------------------------------------------------------- */

typedef struct {
    int64_t activation, packed, format, block_size, zero_points;
    float alpha, limit;
} experts_kernel;

/* -- the packed GEMMs: PackedMatMul, SkipRMSNormMatMul, SwiGLUMatMul ---------------------------- */

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

static inline int64_t panels_of(int64_t n) { return (n + LLMC_PANEL - 1) / LLMC_PANEL; }

/* x [.., K] against a weight packed for n output columns in the kernel's format: [ceil(n / 32), K,
 * 32] float32 or uint16 panels, or a quantized uint8 blob of llmc_quant_bytes. Sets *k. */
OrtStatus *check_packed(const char *op, const linear_kernel *kernel, const tensor *x, const tensor *w, int64_t *k);

/* Panel `panel` of the job's product, by the weight's format. */
static inline void linear_panel(const linear_job *job, int64_t panel) {
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

/* The optional last input: the weight in the lossless format (kernels.h), checked against the
 * fp32 weight's shape. The job reads it when it has few rows, where the weight stream bounds the
 * time; with more, the FMAs do, and the fp32 weight needs no decoding. */
OrtStatus *lossless_input(OrtKernelContext *ctx, const char *op, size_t index, linear_job *job);

/* The job's weight: the fp32 panels, or (format != 0) the 16-bit panels or quantized blob. */
OrtStatus *weight_data(const linear_kernel *kernel, const tensor *w, linear_job *job);

/* -- DecoderLayer ------------------------------------------------------------------------------ */

enum {
    L_X, L_SKIP, L_GAMMA1, L_W_QKV, L_CACHE, L_PAST, L_QLEN, L_TABLES, L_COS, L_SIN, L_POS, L_W_O, L_GAMMA2,
    L_W_GATE_UP, L_W_DOWN, L_QKV_BIAS, L_LOSSLESS, /* then the four lossless copies, QKV to down */
    L_Q_NORM = L_LOSSLESS + 4, L_K_NORM, /* the attention's QK-norm weights */
    L_NUM_IN
};
enum { QKV, O, GATE_UP, DOWN, LINEARS };

typedef struct {
    attention_kernel attention;
    linear_kernel linear[LINEARS]; /* epsilon: QKV's and gate/up's norms */
    _Atomic int64_t threads;       /* how many threads the node's last run had */
} layer_kernel;

/* -- CausalConv1d and GatedDeltaRule (recurrent_ops.c) ------------------------------------------ */

enum { CONV_X, CONV_WEIGHT, CONV_BIAS, CONV_STATE, CONV_PAST, CONV_NUM_IN = CONV_PAST + 3 };
enum { DELTA_Q, DELTA_K, DELTA_V, DELTA_G, DELTA_BETA, DELTA_STATE, DELTA_PAST, DELTA_NUM_IN = DELTA_PAST + 3 };

typedef struct {
    int64_t num_k_heads, num_v_heads, k_head_dim, v_head_dim;
} delta_kernel;

/* -- the ops' compute functions (ORT's KernelComputeV2) ----------------------------------------- */

OrtStatus *attention_compute(void *state, OrtKernelContext *ctx);
OrtStatus *swiglu_compute(void *state, OrtKernelContext *ctx);
OrtStatus *experts_compute(void *state, OrtKernelContext *ctx);
OrtStatus *linear_compute(void *state, OrtKernelContext *ctx);
OrtStatus *norm_linear_compute(void *state, OrtKernelContext *ctx);
OrtStatus *swiglu_linear_compute(void *state, OrtKernelContext *ctx);
OrtStatus *layer_compute(void *state, OrtKernelContext *ctx);
OrtStatus *conv_compute(void *state, OrtKernelContext *ctx);
OrtStatus *delta_compute(void *state, OrtKernelContext *ctx);

#endif
