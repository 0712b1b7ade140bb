/* llmc's CUDA paged attention: the plain C interface of attention.cu.
 *
 * One call runs `llmc::PagedAttention` (llmc/plugins/paged_attention.py is the op's definition and
 * its numpy reference()) on a stream: it writes the step's new K/V into the paged cache in place,
 * then attends. Used by the TensorRT plugin (plugin.cpp) and, through ctypes, by the tests and
 * benchmarks/cuda_attention.py.
 *
 * Layouts (row-major, all on the device):
 *   query   [B, Hq, S, D]     key, value [B, Hkv, S, D]     output [B, Hq, S, D]
 *   cache   [2, num_blocks, block_size, Hkv, D]  (K then V, token-major), updated in place
 *   past_lens [B], query_lens [B], block_tables [B, max_blocks]: int32 on the device
 *     (llmc.contract.graph_io's step inputs are int32 already; int64 callers must cast).
 * Row b holds query_lens[b] new tokens; token j sits at position past_lens[b] + j, is written to
 * block block_tables[b, pos / block_size] at offset pos % block_size and attends causally to
 * positions 0..pos of its row (only those > pos - sliding_window when the window is set). The rest
 * of S is padding: its output rows are zero, and its K/V are not written anywhere (the reference
 * writes them to scratch block 0, which no sequence reads, so the content of block 0 is unspecified).
 * Query head h reads KV head h / (Hq / Hkv).
 *
 * Rotary embedding (optional, rotary_dim > 0): query and key are rotated first, as ONNX's
 * RotaryEmbedding (opset 23) does, and the rotated key is what goes into the cache (values are not
 * rotated). rope_cos and rope_sin are [B, S, rotary_dim / 2] in the query's dtype: token j of row b
 * uses row (b, j). Within the first R = rotary_dim dims of each head, rotary_interleaved = 0 pairs
 * x1 = x[i], x2 = x[i + R/2] (rotate halves, GPT-NeoX/Llama) and 1 pairs x1 = x[2i], x2 = x[2i + 1];
 * out1 = x1*cos[i] - x2*sin[i], out2 = x2*cos[i] + x1*sin[i], in fp32 rounded once to the dtype.
 * Dims R..D-1 pass through.
 *
 * Supported: fp16 and bf16 (fp32 accumulation), head_dim 64 and 128, any block_size >= 1 (16 and
 * 32 are the tested ones), any Hq that Hkv divides. Every pointer must be 16-byte aligned (but
 * rope_cos and rope_sin, which need only their dtype's 2).
 * Block ids outside [0, num_blocks) and positions past the block table are skipped (no write;
 * read as zero) rather than faulting.
 */
#ifndef LLMC_ATTENTION_H
#define LLMC_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever LlmcPagedAttentionArgs or the functions below change; ctypes callers compare it. */
#define LLMC_ATTENTION_ABI_VERSION 3

typedef enum LlmcDtype {
    LLMC_DTYPE_FP16 = 0,
    LLMC_DTYPE_BF16 = 1
} LlmcDtype;

typedef enum LlmcStatus {
    LLMC_OK = 0,
    LLMC_ERR_NULL_POINTER = 1,    /* a required pointer is null */
    LLMC_ERR_BAD_SHAPE = 2,       /* a dimension is negative or zero where it may not be */
    LLMC_ERR_HEAD_DIM = 3,        /* head_dim is not 64 or 128 */
    LLMC_ERR_DTYPE = 4,           /* dtype is not fp16 or bf16 */
    LLMC_ERR_HEADS = 5,           /* num_kv_heads does not divide num_heads */
    LLMC_ERR_ALIGNMENT = 6,       /* a pointer is not 16-byte aligned */
    LLMC_ERR_ATTRIBUTE = 7,       /* negative sliding_window or softcap, or a non-finite scale */
    LLMC_ERR_CUDA = 8,            /* a kernel launch failed (cudaGetLastError) */
    LLMC_ERR_ROTARY = 9           /* rotary_dim odd, negative or > head_dim, rotary_interleaved not 0/1,
                                     or rope_cos/rope_sin not both set (rotary_dim > 0) or both null (0) */
} LlmcStatus;

typedef struct LlmcPagedAttentionArgs {
    const void* query;
    const void* key;
    const void* value;
    void* cache;                  /* read and written in place */
    void* output;
    const int32_t* past_lens;
    const int32_t* query_lens;
    const int32_t* block_tables;
    int32_t batch;                /* B; 0 is a no-op */
    int32_t seq;                  /* S: padded new tokens per row */
    int32_t num_heads;            /* Hq */
    int32_t num_kv_heads;         /* Hkv */
    int32_t head_dim;             /* D */
    int32_t num_blocks;
    int32_t block_size;
    int32_t max_blocks;           /* block_tables' second dimension */
    /* A host-side bound on query_lens (0: S). A decode step padded to S > 1 passes 1 here so it
     * gets the decode kernel; rows past it are written as zeros. */
    int32_t max_query_len;
    int32_t dtype;                /* LlmcDtype */
    float scale;
    float softcap;                /* 0: none */
    int32_t sliding_window;       /* 0: none */
    /* RoPE on query and key (see above): [B, S, rotary_dim / 2] tables in the query's dtype, both
     * null with rotary_dim 0 (no rotation), both set with rotary_dim > 0. 2-byte alignment is enough. */
    const void* rope_cos;
    const void* rope_sin;
    int32_t rotary_dim;           /* R: even, <= head_dim; 0: no RoPE */
    int32_t rotary_interleaved;   /* 0: rotate halves, 1: interleaved pairs */
    /* Scratch for the split-context partials, at least 16-byte aligned. May be null with size 0:
     * the kernel then runs without splitting the context (correct, slower on long contexts with
     * few rows). llmc_paged_attention_workspace() gives the size that allows every split. */
    void* workspace;
    size_t workspace_size;
} LlmcPagedAttentionArgs;

/* Workspace bytes for these shapes (pointers are not read). It is also enough for any call with
 * smaller max_blocks; the TensorRT plugin takes the largest over its batch and seq range. */
size_t llmc_paged_attention_workspace(const LlmcPagedAttentionArgs* args);

/* Write the new K/V, then attend, on `stream`. Returns LLMC_OK or an LlmcStatus; nothing is
 * launched when the arguments are rejected. Asynchronous: kernel faults surface on the stream. */
int llmc_paged_attention(const LlmcPagedAttentionArgs* args, cudaStream_t stream);

/* A one-line description of a status code (static storage). */
const char* llmc_error_string(int status);

/* CUDA's description of the error behind this thread's last LLMC_ERR_CUDA ("no error" if none). */
const char* llmc_last_cuda_error(void);

int llmc_attention_abi_version(void);

/* sizeof(LlmcPagedAttentionArgs), so a ctypes mirror can check its layout. */
size_t llmc_attention_args_size(void);

#ifdef __cplusplus
}
#endif

#endif /* LLMC_ATTENTION_H */
