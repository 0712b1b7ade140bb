/* The arithmetic of llmc's CPU kernels, free of ONNX Runtime: cpu_ops.c binds it to ORT's
 * custom-op ABI. Semantics are those of llmc::PagedAttention (llmc/plugins/paged_attention.py,
 * whose numpy `reference` is the oracle in tests), with two fusions its ORT lowering lacks:
 * - the paged pool is read where it lies: no gathered copy of a row's blocks;
 * - the rotary embedding of Q and K is applied on the way in (ONNX RotaryEmbedding semantics,
 *   cos/sin given per token), and Q/K/V may arrive packed in one [B, S, (Hq + 2 Hkv) D] tensor,
 *   which is what the merged QKV projection produces. */
#ifndef LLMC_KERNELS_H
#define LLMC_KERNELS_H

#include <stdint.h>

#define LLMC_MAX_HEAD_DIM 512

typedef struct {
    int64_t batch, seq, num_heads, num_kv_heads, head_dim;
    int64_t num_blocks, block_size, max_blocks;
    /* Token (b, j) of Q starts at q + (b * seq + j) * q_stride; K and V likewise with kv_stride. */
    const float *q, *k, *v;
    int64_t q_stride, kv_stride;
    /* Rotary embedding: cos/sin are [B or 1, S, rotary_dim / 2]; rotary_dim 0 means none. */
    const float *cos, *sin;
    int64_t rotary_dim, cos_batch_stride;
    int interleaved;
    /* The pool, updated in place, head-major: [2, num_blocks, num_kv_heads, block_size, head_dim],
     * where each (block, KV head) key tile is stored transposed, [head_dim, block_size]. A
     * tile is one contiguous run (4 KB at head_dim 64, block 16), and scoring a block is
     * block-wide vector FMAs with no horizontal sums. */
    float *cache;
    const int32_t *past_lens, *query_lens, *block_tables;
    float *out; /* [B, S, num_heads * head_dim] */
    float scale, softcap;
    int64_t sliding_window;
    int64_t rows_per_task;
    int *out_of_memory; /* set by a task that could not allocate its scratch */
} llmc_attention;

/* Checks the step's metadata against the pool; returns NULL or a message naming the problem. */
const char *llmc_attention_check(const llmc_attention *a);
/* Writes every valid token's (rotated) K and V into its block. Run before any attend task. */
void llmc_attention_write(const llmc_attention *a);
/* Number of independent attend tasks, and one task: (row, query head, tile of query rows). */
int64_t llmc_attention_tasks(const llmc_attention *a);
void llmc_attention_task(const llmc_attention *a, int64_t task);

/* out[r, i] = silu(x[r, i]) * x[r, width + i] for rows [row0, row1): x is [rows, 2 * width]. */
void llmc_swiglu_rows(const float *x, float *out, int64_t width, int64_t row0, int64_t row1);

/* y[M, N] = x[M, K] @ W for W packed as [ceil(N / 32), K, 32] (column panels of 32, zero-padded):
 * each panel streams once from memory while up to 12 rows accumulate in registers, so small-M
 * (decode) products cost the weight read, not M passes over it. Computes panels [p0, p1). */
#define LLMC_PANEL 32
void llmc_linear_panels(const float *x, const float *w_packed, float *y, int64_t m, int64_t k, int64_t n,
                        int64_t p0, int64_t p1);

/* The same product over a lossless copy of the packed weight, 12.5% fewer bytes to stream: each
 * float's top byte (sign and 7 exponent bits) takes only a few values in a panel, so it is stored
 * as a 4-bit code into the panel's 16-entry table, and the low 24 bits as they are. Decoding gives
 * back every float bit for bit, and the FMAs run in the same order as llmc_linear_panels, so the
 * outputs are identical. Layout (llmc/plugins/cpu/lossless.py writes it), K a multiple of 4:
 *   panels: ceil(N / 32) x [table: 16 uint32, each a top byte << 24 | K / 4 groups of 4 k steps:
 *           low 16 bits [4][32] uint16, bits 16-23 [4][32] uint8, codes [4][16] uint8 (column c's
 *           code in the low nibble of byte c, column 16 + c's in its high nibble)]
 *   then int32 offsets[panels + 1] into the exceptions, and the exceptions: pairs of int32
 *   (k * 32 + column, the float's bits) for top bytes outside the table, sorted per panel.
 * Decoding costs ALU work the fp32 kernel does not do: it wins where the weight stream is the
 * bottleneck (few rows) and loses where the FMAs are (16 rows), so the ops use it up to
 * LLMC_LOSSLESS_MAX_ROWS rows and read the fp32 weight above. The kernel is AVX-512 only:
 * elsewhere llmc_lossless_supported() is 0 and the ops read the fp32 weight. */
#define LLMC_LOSSLESS_MAX_ROWS 8
int llmc_lossless_supported(void);
int64_t llmc_lossless_bytes(int64_t k, int64_t n, int64_t exceptions);
void llmc_linear_lossless(const float *x, const uint8_t *w, float *y, int64_t m, int64_t k, int64_t n, int64_t p0,
                          int64_t p1);

/* For rows [row0, row1) of x and skip ([rows, k]): sum = x + skip, and
 * normed = sum / sqrt(mean(sum^2) + epsilon) * gamma (ORT's SkipSimplifiedLayerNormalization). */
void llmc_skip_rmsnorm_rows(const float *x, const float *skip, const float *gamma, float *sum, float *normed,
                            int64_t k, float epsilon, int64_t row0, int64_t row1);

#endif
