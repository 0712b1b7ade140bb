/* What the op files share of ONNX Runtime: calls into ORT's API table (set by ort_glue.c), errors
 * as ORT statuses, a node's input and output tensors, and ORT's intra-op ParallelFor. The helpers
 * the ops call for every input and output on every step are static inline here, so the compiler
 * can fold them into the ops' prologues, a measurable share of a batch-1 step
 * (docs/attention_cpu.md, "Where a batch-1 step's time goes"). */
#ifndef LLMC_ORT_GLUE_H
#define LLMC_ORT_GLUE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ort_abi.h"

/* ORT's API table, set when a session registers the library (RegisterCustomOps). */
extern const OrtApi *api;
extern int shape_by_reference; /* the ORT has GetTensorElementTypeAndShapeDataReference */

#define CALL(slot, type, ...) (((type)api[slot])(__VA_ARGS__))

/* A status naming the op and the problem. */
OrtStatus *error(const char *op, const char *message);

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

/* A tensor's data. */
static inline OrtStatus *data(const OrtValue *value, void **out) {
    return CALL(ORT_GetTensorMutableData, ort_get_data_fn, (OrtValue *)value, out);
}

/* Input `index` of the node: its value, element type and dims; an absent optional input (or one
 * past the node's inputs) leaves t zeroed, value NULL. */
static inline OrtStatus *input(OrtKernelContext *ctx, size_t index, tensor *t) {
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

/* The node's first `count` inputs into t[0 .. count). */
static inline OrtStatus *inputs(OrtKernelContext *ctx, tensor *t, size_t count) {
    for (size_t i = 0; i < count; i++)
        TRY(input(ctx, i, &t[i]));
    return NULL;
}

/* Output `index`, allocated by ORT with these dims, and its data. */
static inline OrtStatus *output(OrtKernelContext *ctx, size_t index, const int64_t *dims, size_t rank, void **out) {
    OrtValue *value;
    TRY(CALL(ORT_KernelContext_GetOutput, ort_get_output_fn, ctx, index, dims, rank, &value));
    return data(value, out);
}

/* fn(arg, 0 .. total - 1) on ORT's intra-op threads, the calling thread among them. */
static inline OrtStatus *parallel(OrtKernelContext *ctx, void (*fn)(void *, size_t), size_t total, void *arg) {
    return CALL(ORT_KernelContext_ParallelFor, ort_parallel_for_fn, ctx, fn, total, 0, arg);
}

#endif
