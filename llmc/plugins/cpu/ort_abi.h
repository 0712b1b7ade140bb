/* The slice of ONNX Runtime's C ABI that the ops use (through ort_glue.h), declared here because
 * the onnxruntime wheel ships no headers. Facts of ORT's stable C API (onnxruntime_c_api.h):
 * - `OrtApi` is a table of function pointers that only ever grows at its end, so a slot's index
 *   is fixed forever; GetApi(v) returns the table of API version v (NULL from an older ORT).
 * - `OrtCustomOp` likewise grows at its end; ORT reads a member only when the op's `version`
 *   is at least the API version that introduced it.
 * Version 17 (ORT 1.17) is the least this library needs: KernelContext_ParallelFor arrived then. */
#ifndef LLMC_ORT_ABI_H
#define LLMC_ORT_ABI_H

#include <stddef.h>
#include <stdint.h>

#define LLMC_ORT_API_VERSION 17
#define LLMC_ORT_OP_VERSION 17

typedef struct OrtStatus OrtStatus;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtShapeInferContext OrtShapeInferContext;
typedef struct OrtCustomOp OrtCustomOp;
typedef void (*ort_fn)(void);
typedef ort_fn OrtApi; /* the API table, indexed by the slots below */

typedef struct OrtApiBase {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

/* Enum values used (ONNXTensorElementDataType, OrtErrorCode, OrtCustomOpInputOutputCharacteristic). */
/* ORT_UNDEFINED as an input's type lets the input take any type (the GEMMs' weight). */
enum { ORT_UNDEFINED = 0, ORT_FLOAT = 1, ORT_UINT8 = 2, ORT_INT8 = 3, ORT_UINT16 = 4, ORT_INT32 = 6, ORT_INT64 = 7, ORT_FLOAT16 = 10,
       ORT_BFLOAT16 = 16 };
enum { ORT_INVALID_ARGUMENT = 2 };
enum { ORT_REQUIRED = 0, ORT_OPTIONAL = 1 };

/* OrtApi slots (zero-based index into the table) and their signatures. */
#define ORT_CreateStatus 0
typedef OrtStatus *(*ort_create_status_fn)(int code, const char *msg);
#define ORT_CreateCustomOpDomain 26
typedef OrtStatus *(*ort_create_domain_fn)(const char *domain, OrtCustomOpDomain **out);
#define ORT_CustomOpDomain_Add 27
typedef OrtStatus *(*ort_domain_add_fn)(OrtCustomOpDomain *domain, const OrtCustomOp *op);
#define ORT_AddCustomOpDomain 28
typedef OrtStatus *(*ort_add_domain_fn)(OrtSessionOptions *options, OrtCustomOpDomain *domain);
#define ORT_GetTensorMutableData 51
typedef OrtStatus *(*ort_get_data_fn)(OrtValue *value, void **out);
#define ORT_GetTensorElementType 60
typedef OrtStatus *(*ort_get_elem_type_fn)(const OrtTensorTypeAndShapeInfo *info, int32_t *out);
#define ORT_GetDimensionsCount 61
typedef OrtStatus *(*ort_get_dims_count_fn)(const OrtTensorTypeAndShapeInfo *info, size_t *out);
#define ORT_GetDimensions 62
typedef OrtStatus *(*ort_get_dims_fn)(const OrtTensorTypeAndShapeInfo *info, int64_t *dims, size_t count);
#define ORT_GetTensorTypeAndShape 65
typedef OrtStatus *(*ort_get_type_shape_fn)(const OrtValue *value, OrtTensorTypeAndShapeInfo **out);
#define ORT_KernelInfoGetAttribute_float 85
typedef OrtStatus *(*ort_attr_float_fn)(const OrtKernelInfo *info, const char *name, float *out);
#define ORT_KernelInfoGetAttribute_int64 86
typedef OrtStatus *(*ort_attr_int_fn)(const OrtKernelInfo *info, const char *name, int64_t *out);
#define ORT_KernelContext_GetInputCount 88
typedef OrtStatus *(*ort_get_count_fn)(const OrtKernelContext *ctx, size_t *out);
#define ORT_KernelContext_GetOutputCount 89
#define ORT_KernelContext_GetInput 90
typedef OrtStatus *(*ort_get_input_fn)(const OrtKernelContext *ctx, size_t index, const OrtValue **out);
#define ORT_KernelContext_GetOutput 91
typedef OrtStatus *(*ort_get_output_fn)(OrtKernelContext *ctx, size_t index, const int64_t *dims, size_t count,
                                        OrtValue **out);
#define ORT_ReleaseStatus 93
typedef void (*ort_release_status_fn)(OrtStatus *status);
#define ORT_ReleaseTensorTypeAndShapeInfo 99
typedef void (*ort_release_fn)(OrtTensorTypeAndShapeInfo *info);
#define ORT_ShapeInferContext_GetInputTypeShape 268
typedef OrtStatus *(*ort_infer_input_fn)(const OrtShapeInferContext *ctx, size_t index,
                                         OrtTensorTypeAndShapeInfo **info); /* the context owns *info */
#define ORT_ShapeInferContext_SetOutputTypeShape 270
typedef OrtStatus *(*ort_infer_output_fn)(const OrtShapeInferContext *ctx, size_t index,
                                          const OrtTensorTypeAndShapeInfo *info);
#define ORT_KernelContext_ParallelFor 274
typedef OrtStatus *(*ort_parallel_for_fn)(const OrtKernelContext *ctx, void (*fn)(void *, size_t), size_t total,
                                          size_t num_batch, void *user_data);

/* API 24 (ORT 1.24) on: a tensor's element type and shape without allocating the type-and-shape
 * object the calls above need (shape points into the value, valid while it lives). */
#define LLMC_ORT_API_SHAPE_REF 24
#define ORT_GetTensorElementTypeAndShapeDataReference 414
typedef OrtStatus *(*ort_type_shape_ref_fn)(const OrtValue *value, int32_t *type, const int64_t **shape,
                                            size_t *count);

/* A custom op's description, member order as ORT reads it (through version 17: GetEndVersion). */
struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const struct OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info);
    const char *(*GetName)(const struct OrtCustomOp *op);
    const char *(*GetExecutionProviderType)(const struct OrtCustomOp *op);
    int32_t (*GetInputType)(const struct OrtCustomOp *op, size_t index);
    size_t (*GetInputTypeCount)(const struct OrtCustomOp *op);
    int32_t (*GetOutputType)(const struct OrtCustomOp *op, size_t index);
    size_t (*GetOutputTypeCount)(const struct OrtCustomOp *op);
    void (*KernelCompute)(void *kernel, OrtKernelContext *ctx);
    void (*KernelDestroy)(void *kernel);
    int32_t (*GetInputCharacteristic)(const struct OrtCustomOp *op, size_t index);
    int32_t (*GetOutputCharacteristic)(const struct OrtCustomOp *op, size_t index);
    int32_t (*GetInputMemoryType)(const struct OrtCustomOp *op, size_t index);
    int (*GetVariadicInputMinArity)(const struct OrtCustomOp *op);
    int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp *op);
    int (*GetVariadicOutputMinArity)(const struct OrtCustomOp *op);
    int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp *op);
    OrtStatus *(*CreateKernelV2)(const struct OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                 void **kernel);
    OrtStatus *(*KernelComputeV2)(void *kernel, OrtKernelContext *ctx);
    OrtStatus *(*InferOutputShapeFn)(const struct OrtCustomOp *op, OrtShapeInferContext *ctx);
    int (*GetStartVersion)(const struct OrtCustomOp *op);
    int (*GetEndVersion)(const struct OrtCustomOp *op);
};

#endif
