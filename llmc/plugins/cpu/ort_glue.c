/* ONNX Runtime custom-op library: domain "llmc.cpu", ops PagedAttention, SwiGLU, PackedMatMul
 * (optionally with each row's argmax), SkipRMSNormMatMul, SwiGLUMatMul, DecoderLayer (a
 * layer's five of them as one node), Experts (a mixture-of-experts layer's experts) and the
 * hybrid models' recurrent layers, CausalConv1d and GatedDeltaRule.
 * ORT calls RegisterCustomOps when a session registers this library; the kernels then run on
 * ORT's intra-op thread pool (KernelContext_ParallelFor), so they share its threads and spinning
 * settings instead of bringing threads of their own.
 * This file is the glue to ORT: its API table, the ops' tensors, and each op's description
 * (attributes, input and output types) and registration. ops.c and decoder_layer.c compute the
 * ops; threads.c schedules DecoderLayer's steps. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "ops.h"
#include "ort_abi.h"
#include "ort_glue.h"

#define EXPORT __attribute__((visibility("default")))

const OrtApi *api;
int shape_by_reference;

OrtStatus *error(const char *op, const char *message) {
    char text[256];
    snprintf(text, sizeof text, "llmc.cpu::%s: %s", op, message);
    return CALL(ORT_CreateStatus, ort_create_status_fn, ORT_INVALID_ARGUMENT, text);
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

static const char *const linear_prefix[LINEARS] = {"qkv_", "o_", "gate_up_", "down_"};

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

static const char *read_conv(const OrtKernelInfo *info, void *kernel) {
    int64_t *activation = kernel;
    read_int(info, "activation", LLMC_CONV_ACT_NONE, activation);
    return *activation != LLMC_CONV_ACT_NONE && *activation != LLMC_CONV_ACT_SILU
               ? "attribute activation must be 0 (none) or 1 (SiLU)" : NULL;
}

static OrtStatus *conv_create(const OrtCustomOp *op, const OrtApi *ort, const OrtKernelInfo *info,
                              void **kernel_out) {
    (void)op;
    (void)ort;
    return new_kernel("CausalConv1d", sizeof(int64_t), read_conv, info, kernel_out);
}

static const char *read_delta(const OrtKernelInfo *info, void *kernel) {
    delta_kernel *k = kernel;
    read_int(info, "num_k_heads", 0, &k->num_k_heads);
    read_int(info, "num_v_heads", 0, &k->num_v_heads);
    read_int(info, "k_head_dim", 0, &k->k_head_dim);
    read_int(info, "v_head_dim", 0, &k->v_head_dim);
    if (k->num_k_heads <= 0 || k->num_v_heads <= 0 || k->k_head_dim <= 0 || k->v_head_dim <= 0)
        return "attributes num_k_heads, num_v_heads, k_head_dim and v_head_dim must be positive";
    if (k->num_v_heads % k->num_k_heads != 0)
        return "attribute num_v_heads must be a multiple of num_k_heads";
    return k->k_head_dim > LLMC_DELTA_MAX_DIM || k->v_head_dim > LLMC_DELTA_MAX_DIM
               ? "k_head_dim and v_head_dim above 512 are not supported" : NULL;
}

static OrtStatus *delta_create(const OrtCustomOp *op, const OrtApi *ort, const OrtKernelInfo *info,
                               void **kernel_out) {
    (void)op;
    (void)ort;
    return new_kernel("GatedDeltaRule", sizeof(delta_kernel), read_delta, info, kernel_out);
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

/* The recurrent ops: their lengths and slots are int32, the rest float32; what follows the token
 * inputs (bias, and the pool with its lengths and slots) optional, as is the pool's output. */
static int32_t conv_input_type(const OrtCustomOp *op, size_t i) { (void)op; return i >= CONV_PAST ? ORT_INT32 : ORT_FLOAT; }
static int32_t conv_input_kind(const OrtCustomOp *op, size_t i) { (void)op; return i >= CONV_BIAS ? ORT_OPTIONAL : ORT_REQUIRED; }
static int32_t delta_input_type(const OrtCustomOp *op, size_t i) { (void)op; return i >= DELTA_PAST ? ORT_INT32 : ORT_FLOAT; }
static int32_t delta_input_kind(const OrtCustomOp *op, size_t i) { (void)op; return i >= DELTA_STATE ? ORT_OPTIONAL : ORT_REQUIRED; }

static op_description attention_op, swiglu_op, linear_op, norm_linear_op, swiglu_linear_op, layer_op, experts_op, conv_op, delta_op;

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
        define(&conv_op, "CausalConv1d", conv_create, conv_compute, CONV_NUM_IN, 2, conv_input_type, conv_input_kind);
        conv_op.op.GetOutputCharacteristic = linear_output_kind;
        define(&delta_op, "GatedDeltaRule", delta_create, delta_compute, DELTA_NUM_IN, 2, delta_input_type,
               delta_input_kind);
        delta_op.op.GetOutputCharacteristic = linear_output_kind;
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
    TRY(CALL(ORT_CustomOpDomain_Add, ort_domain_add_fn, domain, &conv_op.op));
    TRY(CALL(ORT_CustomOpDomain_Add, ort_domain_add_fn, domain, &delta_op.op));
    return CALL(ORT_AddCustomOpDomain, ort_add_domain_fn, options, domain);
}
