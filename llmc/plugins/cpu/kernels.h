/* The arithmetic of llmc's CPU kernels, free of ONNX Runtime: the ops (ops.c, decoder_layer.c;
 * ort_glue.c registers them) bind it to ORT's custom-op ABI. Semantics are those of
 * llmc::PagedAttention (llmc/plugins/paged_attention.py, whose numpy `reference` is the oracle in
 * tests), with two fusions its ORT lowering lacks:
 * - the paged pool is read where it lies: no gathered copy of a row's blocks;
 * - the rotary embedding of Q and K is applied on the way in (ONNX RotaryEmbedding semantics,
 *   cos/sin given per token, or as tables indexed by position), and Q/K/V may arrive packed in one [B, S, (Hq + 2 Hkv) D] tensor,
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
    /* Rotary embedding: cos/sin are [B or 1, S, rotary_dim / 2]; rotary_dim 0 means none. With
     * positions ([B, S]), cos/sin are instead tables [rotary_rows, rotary_dim / 2] and token (b, j)
     * takes row positions[b * seq + j]. */
    const float *cos, *sin;
    int64_t rotary_dim, cos_batch_stride;
    const int64_t *positions;
    int64_t rotary_rows;
    int interleaved;
    /* QK-norm (Qwen3, Gemma 3): when set, each query / key head is RMS-normalized with these
     * [head_dim] weights and norm_eps before it is rotated, as the exported graph's
     * RMSNormalization over the head did: x / sqrt(mean(x^2) + eps) * w. */
    const float *q_norm, *k_norm;
    float norm_eps;
    /* The pool, updated in place, head-major: [2, num_blocks, num_kv_heads, block_size, head_dim],
     * where each (block, KV head) key tile is stored transposed, [head_dim, block_size]. A
     * tile is one contiguous run (4 KB at head_dim 64, block 16), and scoring a block is
     * block-wide vector FMAs with no horizontal sums.
     * kv_type (the pool input's element type, llmc build --kv-cache-dtype) picks what a tile holds:
     * - LLMC_KV_FP32, LLMC_KV_FP16, LLMC_KV_BF16: that shape, float32 / IEEE half / bfloat16
     *   elements, the rotated K and V rounded to nearest even;
     * - LLMC_KV_INT8: [2, num_blocks, num_kv_heads, block_size * (head_dim + 4)] bytes: each
     *   (plane, block, KV head) tile is block_size * head_dim int8 values laid out as the float
     *   tiles (keys [head_dim, block_size], values [block_size, head_dim]), then block_size float32
     *   scales, one per token: scale = max|x| / 127 over the token's head_dim values,
     *   q = round-half-even(x / scale) (0 where scale is 0), read back as q * scale.
     * Tasks convert each tile they read to float32 in a scratch tile, then score and weigh it as
     * fp32 tiles; int8 scores are scaled per key column and int8 values' scales are folded into
     * the softmax weights. */
    void *cache;
    int kv_type;
    const int32_t *past_lens, *query_lens, *block_tables;
    float *out; /* [B, S, num_heads * head_dim] */
    float scale, softcap;
    /* Attention sinks (gpt-oss): [num_heads] logits, each joining its head's softmax as a key that
     * weighs no value; NULL: none. */
    const float *sinks;
    int64_t sliding_window;
    int64_t rows_per_task;
    /* Key chunks per decode row (llmc_attention_splits) and, when above 1, the chunks' partial
     * results, llmc_attention_partial_floats of them, merged by llmc_attention_combine. */
    int64_t splits;
    float *partial;
    int *out_of_memory; /* set by a task that could not allocate its scratch */
} llmc_attention;

/* The CPUs online (at least 1), read once: how finely the kernels split their work. */
int64_t llmc_cpus(void);

enum { LLMC_KV_FP32 = 0, LLMC_KV_FP16 = 1, LLMC_KV_BF16 = 2, LLMC_KV_INT8 = 3 };
/* Bytes of one (plane, block, KV head) tile of the pool. */
int64_t llmc_attention_tile_bytes(const llmc_attention *a);
/* Checks the step's metadata against the pool; returns NULL or a message naming the problem. */
const char *llmc_attention_check(const llmc_attention *a);
/* Writes every valid token's (rotated) K and V into its block. Run before any attend task. */
void llmc_attention_write(const llmc_attention *a);
/* Set rows_per_task, then splits = llmc_attention_splits(a) (and partial, when splits > 1). */
int64_t llmc_attention_splits(const llmc_attention *a);
int64_t llmc_attention_partial_floats(const llmc_attention *a);
/* Number of independent attend tasks, and one task: (row, query heads, tile of query rows, key
 * chunk). With splits > 1, llmc_attention_combine writes the output once every task has run. */
int64_t llmc_attention_tasks(const llmc_attention *a);
void llmc_attention_task(const llmc_attention *a, int64_t task);
void llmc_attention_combine(const llmc_attention *a);

/* The gate's activation of a gated MLP: SiLU (SwiGLU), or GELU's tanh approximation (GeGLU:
 * Gemma's gelu_pytorch_tanh); the experts also take gpt-oss's clamped SwiGLU,
 * (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit). */
enum { LLMC_ACT_SILU = 0, LLMC_ACT_GELU_TANH = 1, LLMC_ACT_CLAMPED_SWIGLU = 2 };
/* out[r, i] = act(x[r, i]) * x[r, width + i] for rows [row0, row1): x is [rows, 2 * width]. */
void llmc_swiglu_rows(const float *x, float *out, int64_t width, int64_t row0, int64_t row1, int activation);

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

/* -- quantized and 16-bit weights (quant.c; llmc/plugins/cpu/quant.py writes them) -------------
 * The ops' node attribute weight_format picks one (LLMC_FORMAT_*). The 16-bit formats are the
 * fp32 panels [ceil(N / 32), K, 32] with uint16 elements (bf16: a float's top half; fp16: IEEE
 * half), converted in the tile, fp32 arithmetic. The quantized ones are blockwise along K
 * (ONNX DequantizeLinear, axis 0, block B in {32, 64, 128}): w[k, c] = (q[k, c] - zp[k / B, c]) *
 * scale[k / B, c], stored as one uint8 blob of 32-column panels, each K / B blocks of
 *   scale: 32 float16 (64 bytes) | zero points: 32 int8 (asymmetric only; int8: zp - 128) |
 *   B / 4 groups of 4 k steps: int8: [32 columns][4 k] bytes (asymmetric: q - 128);
 *                              int4: two 32-byte vectors, columns 0-15 then 16-31, each byte
 *                              i = column % 8 * 4 + k % 4 with column c % 16 < 8 in its low nibble
 *                              and c + 8 in its high one (symmetric: q + 8);
 *                              int6: int4's 64 bytes holding the low 4 bits, then 32 bytes of
 *                              the high 2: byte i = column % 8 * 4 + k % 4 holds column
 *                              c % 8 + 8 * j at bits 2j..2j+1 (symmetric: q + 32).
 * int4 symmetric at B = 32 is 576 bytes per 1024 weights: 4.5 bits a weight; int6 6.5. Padding columns of
 * the last panel have scale 0. The activations are quantized per row and block: sx = max|x| / 127,
 * xq = round-half-even(x * (1 / sx)) in int8 (a zero block: 0), then
 * y[r, c] = sum over blocks of scale[c] * sx[r] * sum_k xq * (q - zp), integer inner sums.
 * mxfp4 (OCP Microscaling, gpt-oss's expert weights) holds a checkpoint's bytes rearranged, never
 * requantized: B = 32 always, no zero points, each block of a panel
 *   scale: 32 E8M0 bytes e (2^(e - 127)) | 8 groups of 4 k steps: int4's 64 nibble bytes, each
 *   nibble an E2M1 code (bit 3 the sign, code & 7 indexes 0, 0.5, 1, 1.5, 2, 3, 4, 6),
 * 544 bytes per 1024 weights: 4.25 bits a weight. Padding columns: code 0, scale byte 127. The
 * codes read as the integers 2 * value (0, 1, 2, 3, 4, 6, 8, 12 and negatives), so
 * y[r, c] = sum over blocks of sx[r] * 2^(e[c] - 128) * sum_k xq * 2 value, the block's factor
 * being float32(2^(e - 127)) / 2: 2^-128 at e = 0 (a subnormal float, as transformers' weights
 * there), +inf at e = 255 (2^128 overflows float32, as in transformers' ldexp, whose weights are
 * then +-inf: the column's outputs are inf or NaN). */
enum {
    LLMC_FORMAT_FP32 = 0,
    LLMC_FORMAT_BF16 = 1,
    LLMC_FORMAT_FP16 = 2,
    LLMC_FORMAT_INT8 = 3,
    LLMC_FORMAT_INT4 = 4,
    LLMC_FORMAT_INT6 = 5,
    LLMC_FORMAT_MXFP4 = 6
};
/* The bits of a quantized format (mxfp4: 4), or 0 for the others: whether a weight is a blob of
 * llmc_quant_bytes that llmc_linear_quant reads. */
static inline int llmc_format_bits(int64_t format) {
    return format == LLMC_FORMAT_INT8    ? 8
           : format == LLMC_FORMAT_INT6  ? 6
           : format == LLMC_FORMAT_INT4  ? 4
           : format == LLMC_FORMAT_MXFP4 ? 4
                                         : 0;
}

/* A quantized format's bytes per block of a panel, and a [k, n] weight's blob (format LLMC_FORMAT_*). */
int64_t llmc_quant_block_bytes(int format, int64_t block, int zero_points);
int64_t llmc_quant_bytes(int64_t k, int64_t n, int format, int64_t block, int zero_points);

/* Rows quantized once per op call, before the parallel loop over panels (a scratch of
 * llmc_qact_bytes). */
typedef struct {
    int8_t *q;    /* [m, k] */
    float *scale; /* [m, k / block]: sx */
    float *sum;   /* [m, k / 32]: the sum of q over each 32 k steps (an integer, as a float) */
    int64_t m, k, block;
} llmc_qact;
int64_t llmc_qact_bytes(int64_t m, int64_t k, int64_t block);
void llmc_qact_init(llmc_qact *a, void *scratch, int64_t m, int64_t k, int64_t block);
void llmc_quantize_rows(const llmc_qact *a, const float *x, int64_t row0, int64_t row1);

/* y[m, n] = the quantized rows times a quantized blob of `format` (LLMC_FORMAT_INT8, INT6, INT4 or
 * MXFP4), panels [p0, p1). AVX2 where the CPU has it (llmc_quant_fast_path), AVX-512 VNNI where it
 * has that, plain C elsewhere: the same integer sums either way. */
void llmc_linear_quant(const llmc_qact *a, const uint8_t *w, float *y, int64_t n, int format, int zero_points,
                       int64_t p0, int64_t p1);
/* y[m, n] = x @ W for 16-bit panels, panels [p0, p1). */
void llmc_linear_16bit(const float *x, const uint16_t *w, float *y, int64_t m, int64_t k, int64_t n, int bf16,
                       int64_t p0, int64_t p1);
int llmc_quant_fast_path(void);

/* -- mixture-of-experts layers (experts.c) -------------------------------------------------------
 * out[t] = sum over slots s of weights[t, s] * down_e(act(gate_e(x[t])) * up_e(x[t])), e = ids[t, s]
 * (each product plus expert e's bias where the op has them: gate_up_bias [E, 2 inter], down_bias [E, hidden]):
 * llmc.cpu::Experts, what transformers' experts module computes from the router's choice. The
 * weights, per expert: gate_up [2 * inter, hidden] (gate rows, then up rows) and down
 * [hidden, inter], either as the checkpoint holds them (fp32, packed 0) or each expert as a packed
 * GEMM reads a [K, N] weight: fp32 panels (packed 1: gate_up [E, ceil(2 inter / 32), hidden, 32],
 * down [E, ceil(hidden / 32), inter, 32]) or a quantized blob (format LLMC_FORMAT_INT* or MXFP4,
 * the experts' blobs one after another). A call plans (pairs sorted by expert, rows gathered), then
 * runs the up products, the activation, the down products, then combines; the ORT binding
 * (ops.c) runs each phase's tasks in parallel and, for a quantized format, quantizes each
 * phase's rows once (up_rows, down_rows) before its products. */
typedef struct {
    int64_t tokens, top_k, hidden, inter, experts;
    const float *x;          /* [tokens, hidden] */
    const int64_t *ids;      /* [tokens, top_k] */
    const float *weights;    /* [tokens, top_k] */
    const void *gate_up, *down;
    const float *gate_up_bias, *down_bias; /* or NULL */
    int packed, activation;  /* LLMC_ACT_* */
    float alpha, limit;      /* LLMC_ACT_CLAMPED_SWIGLU's */
    int format, zero_points; /* LLMC_FORMAT_*: fp32 (by packed) or a quantized one */
    int64_t block_size;
    float *out;              /* [tokens, hidden] */
    /* scratch, pairs = tokens * top_k: */
    int64_t *start;          /* [experts + 1]: expert e's rows are [start[e], start[e + 1]) */
    int64_t *used, num_used; /* [experts]: the experts some pair chose, ascending */
    int64_t *slot, *row_of;  /* [pairs] each: the pair a row holds; the row a pair is at */
    float *rows;             /* [pairs, hidden]: x gathered by expert */
    float *gate_up_out;      /* [pairs, 2 * inter] */
    float *act;              /* [pairs, inter] */
    float *down_out;         /* [pairs, hidden] */
    llmc_qact up_rows, down_rows; /* quantized formats: rows and act, quantized */
} llmc_experts;
/* NULL, or what is wrong with the ids. Counts the chosen experts' bytes into llmc_experts_bytes_read. */
const char *llmc_experts_plan(llmc_experts *a);
/* Expert weight and bias bytes every call so far has read (each chosen expert once a call). */
uint64_t llmc_experts_bytes_read(void);
/* The column groups (32 wide) of an n-column product: the unit the up and down phases split. */
int64_t llmc_experts_groups(int64_t n);
void llmc_experts_up(const llmc_experts *a, int64_t e, int64_t g0, int64_t g1);
void llmc_experts_down(const llmc_experts *a, int64_t e, int64_t g0, int64_t g1);
/* Rows [r0, r1) of gate_up_out, their expert's bias added, through the activation into act. */
void llmc_experts_activate(const llmc_experts *a, int64_t r0, int64_t r1);
void llmc_experts_combine(const llmc_experts *a, int64_t t0, int64_t t1);

/* -- recurrent layers (recurrent.c): llmc.cpu::CausalConv1d and llmc.cpu::GatedDeltaRule --------
 * Hybrid models' token mixers whose per-sequence state is a fixed-size recurrent state, not a
 * growing KV cache: LFM2's short convolution and Qwen3.5's Gated DeltaNet (its convolution too).
 * The state lives in a pool of slots, [slots, ...], that the runtime binds as the op's state
 * input and state_out output, one buffer updated in place (as PagedAttention's kv_cache); where
 * the two differ (a plain session.run) the op copies the input over first. Each row b of the
 * batch brings past_lens[b] (0: the sequence starts here, its slot's old contents are ignored),
 * query_lens[b] (n, 0 <= n <= S: tokens past n are padding, their outputs 0) and state_slots[b]
 * (its slot; rows' slots must be distinct). After the call, the row's slot holds its state after
 * its n tokens (n = 0 keeps the state, or zeros when past_lens[b] is 0). Without a pool (the state
 * inputs absent) every row starts from zeros and all S tokens are valid.
 *
 * CausalConv1d(x [B, S, C], weight [C, K], bias [C]?, state [slots, K - 1, C]?, past_lens [B]?,
 *              query_lens [B]?, state_slots [B]?) -> y [B, S, C], state_out?; attribute
 * activation (LLMC_CONV_ACT_*). A depthwise causal Conv1d (HF's conv.weight[:, 0, :]): with
 * in = the K - 1 inputs before the step (the slot's state, oldest first, or zeros) then
 * x[b, 0:n], y[b, t, c] = act(bias[c] + sum_j weight[c, j] in[t + j, c]) for t < n, and the slot
 * keeps in's last K - 1 rows (transformers' causal_conv1d_fn / causal_conv1d_update). Tasks are
 * (row, block of LLMC_CONV_BLOCK channels), the weights transposed per task so every loop runs
 * along the channels.
 *
 * GatedDeltaRule(q [B, S, Hk, dk], k [B, S, Hk, dk], v [B, S, Hv, dv], g [B, S, Hv], beta [B, S, Hv],
 *                state [slots, Hv, dk, dv]?, past_lens [B]?, query_lens [B]?, state_slots [B]?)
 *   -> out [B, S, Hv, dv], state_out?; attributes num_k_heads, num_v_heads, k_head_dim,
 * v_head_dim (q/k/v may also be [B, S, H * d]). transformers' torch_recurrent_gated_delta_rule
 * with use_qk_l2norm_in_kernel: value head h reads q/k head h / (Hv / Hk); q and k are scaled by
 * rsqrt(sum x^2 + 1e-6), q then by dk^-0.5; per valid token, with the state S [dk, dv]:
 * S *= exp(g); delta = (v - k^T S) beta; S += k delta^T; out = q^T S. Tasks are (row, value
 * head). Each token is one pass over S: S's decay and update for token t, out_t and the next
 * token's k^T S accumulate in that same pass (exp(g) scales S's rows as they are updated); the
 * first token's k^T S takes one more, so a decode step is two passes. */
enum { LLMC_CONV_ACT_NONE = 0, LLMC_CONV_ACT_SILU = 1 };
#define LLMC_CONV_MAX_WIDTH 16
#define LLMC_CONV_BLOCK 128
#define LLMC_DELTA_MAX_DIM 512

/* A step's rows and their slots in the pool; state_slots NULL: no pool (every row from zeros,
 * all seq tokens valid). */
typedef struct {
    int64_t batch, seq, slots;
    const int32_t *past_lens, *query_lens, *state_slots;
} llmc_recurrent_rows;
/* NULL, or what is wrong with the rows' lengths and slots. */
const char *llmc_recurrent_check(const llmc_recurrent_rows *r);

typedef struct {
    llmc_recurrent_rows rows;
    int64_t channels, width; /* C, K */
    const float *x, *weight, *bias; /* bias NULL: none */
    float *y;
    float *state; /* the pool, [slots, K - 1, C]; NULL without one */
    int activation;
} llmc_conv;
int64_t llmc_conv_tasks(const llmc_conv *c);
void llmc_conv_task(const llmc_conv *c, int64_t task);

typedef struct {
    llmc_recurrent_rows rows;
    int64_t num_k_heads, num_v_heads, k_dim, v_dim;
    const float *q, *k, *v, *g, *beta;
    float *out;
    /* The pool [slots, Hv, dk, dv]; without one, a scratch [B, Hv, dk, dv] (row b in slot b). */
    float *state;
} llmc_delta;
int64_t llmc_delta_tasks(const llmc_delta *d);
void llmc_delta_task(const llmc_delta *d, int64_t task);

#endif
