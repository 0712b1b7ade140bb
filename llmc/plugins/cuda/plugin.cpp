// TensorRT plugin for llmc::PagedAttention (IPluginV3, TensorRT 10.x / 11.x).
//
// Inputs (llmc/plugins/paged_attention.py INPUTS): query [B,Hq,S,D], key [B,Hkv,S,D],
// value [B,Hkv,S,D], cache [2,num_blocks,block_size,Hkv,D], past_lens [B], query_lens [B],
// block_tables [B,max_blocks], then optionally cos and sin [B,S,R/2] (9 inputs): the fused RoPE of
// query and key (ONNX RotaryEmbedding, rotary dim R = 2 * cos.shape[-1] <= D; field
// rotary_interleaved picks the pairing), applied before the op, so the cache holds rotated keys.
// Outputs: output [B,Hq,S,D], cache_out (cache's shape). Float tensors (cos and sin included) are
// all fp16 or all bf16; the lengths and block tables are int32 (graph_io's step inputs). The
// kernels are attention.cu's llmc_paged_attention.
//
// cache_out is declared aliased to cache (IPluginV3OneBuildV2::getAliasedInput, TensorRT >= 10.3),
// which takes effect when the builder enables PreviewFeature::kALIASED_PLUGIN_IO_10_03; the
// kernels then update the pool in place. Without it TensorRT gives cache_out its own buffer and
// enqueue copies the whole pool into it first: correct, but a pool-sized copy per layer and step.
//
// Loading: the library exports getCreators and setLoggerFinder, the entry points of
// IPluginRegistry::loadLibrary and `trtexec --dynamicPlugins`. It does not also self-register
// with REGISTER_TENSORRT_PLUGIN: loadLibrary refuses a creator that is already registered.
// An ONNX node reaches this creator by op type "PagedAttention" with the attributes
// plugin_namespace="llmc" and plugin_version="1" (how TensorRT's ONNX parser picks a plugin).

#include "llmc_attention.h"

#include <NvInferRuntime.h>
#include <NvInferVersion.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#if NV_TENSORRT_MAJOR > 10 || (NV_TENSORRT_MAJOR == 10 && NV_TENSORRT_MINOR >= 3)
#define LLMC_TRT_ALIASED_IO 1
#else
#define LLMC_TRT_ALIASED_IO 0
#endif

#define LLMC_EXPORT extern "C" __attribute__((visibility("default")))

namespace llmc_trt {

using namespace nvinfer1;

// Must equal paged_attention.py's OP_TYPE, DOMAIN and VERSION (tests/test_cuda_kernels.py checks).
constexpr char kPluginName[] = "PagedAttention";
constexpr char kPluginNamespace[] = "llmc";
constexpr char kPluginVersion[] = "1";

enum Input : int32_t { kQuery, kKey, kValue, kCache, kPastLens, kQueryLens, kBlockTables, kCos, kSin };
enum Output : int32_t { kOutput, kCacheOut, kNumOutputs };
// The node has the 7 inputs of the op, or 9 with the optional cos and sin of a fused RoPE.
constexpr int32_t kNumInputs = kBlockTables + 1;
constexpr int32_t kNumInputsRope = kSin + 1;

bool valid_io(int32_t nbInputs, int32_t nbOutputs) {
    return (nbInputs == kNumInputs || nbInputs == kNumInputsRope) && nbOutputs == kNumOutputs;
}

class LoggerFinder {
public:
    void set(ILoggerFinder* finder) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (finder_ == nullptr) finder_ = finder;
    }
    void error(std::string const& msg) noexcept {
        try {
            std::lock_guard<std::mutex> lock(mutex_);
            ILogger* logger = finder_ ? finder_->findLogger() : nullptr;
            if (logger) logger->log(ILogger::Severity::kERROR, ("llmc PagedAttention: " + msg).c_str());
        } catch (...) {
        }
    }

private:
    std::mutex mutex_;
    ILoggerFinder* finder_ = nullptr;
};

LoggerFinder& logger() {
    static LoggerFinder instance;
    return instance;
}

// The op's attributes: PagedAttentionAttrs in paged_attention.py.
struct Attrs {
    int32_t num_heads = 0;
    int32_t num_kv_heads = 0;
    float scale = 0.f;
    int32_t sliding_window = 0;
    float softcap = 0.f;
    int32_t rotary_interleaved = 0;   // with cos/sin inputs: 0 rotate halves, 1 interleaved pairs

    std::string invalid() const {
        if (num_heads <= 0 || num_kv_heads <= 0) return "num_heads and num_kv_heads must be positive";
        if (num_heads % num_kv_heads != 0) return "num_kv_heads must divide num_heads";
        if (!std::isfinite(scale)) return "scale must be finite";
        if (sliding_window < 0) return "sliding_window must be >= 0";
        if (!(softcap >= 0.f) || !std::isfinite(softcap)) return "softcap must be >= 0";
        if (rotary_interleaved != 0 && rotary_interleaved != 1) return "rotary_interleaved must be 0 or 1";
        return {};
    }
};

bool is_float(DataType t) { return t == DataType::kHALF || t == DataType::kBF16; }

#if LLMC_TRT_ALIASED_IO
using BuildInterface = IPluginV3OneBuildV2;
#else
using BuildInterface = IPluginV3OneBuild;
#endif

class PagedAttentionPlugin : public IPluginV3, public IPluginV3OneCore, public BuildInterface, public IPluginV3OneRuntime {
public:
    explicit PagedAttentionPlugin(Attrs const& attrs) : attrs_(attrs) { init_fields(); }
    PagedAttentionPlugin(PagedAttentionPlugin const& other) : attrs_(other.attrs_), rope_(other.rope_) { init_fields(); }
    PagedAttentionPlugin& operator=(PagedAttentionPlugin const&) = delete;
    ~PagedAttentionPlugin() override = default;

    // IPluginV3
    IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
        switch (type) {
            case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
            case PluginCapabilityType::kBUILD: return static_cast<BuildInterface*>(this);
            case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }

    IPluginV3* clone() noexcept override {
        try {
            return new PagedAttentionPlugin(*this);
        } catch (std::exception const& e) {
            logger().error(e.what());
        }
        return nullptr;
    }

    // IPluginV3OneCore
    AsciiChar const* getPluginName() const noexcept override { return kPluginName; }
    AsciiChar const* getPluginVersion() const noexcept override { return kPluginVersion; }
    AsciiChar const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override { return kNumOutputs; }

    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* /*out*/,
                            int32_t nbOutputs) noexcept override {
        if (!valid_io(nbInputs, nbOutputs)) return fail("expects 7 inputs (9 with cos and sin) and 2 outputs");
        rope_ = nbInputs == kNumInputsRope;
        if (rope_) {
            int32_t const status = check_rope_dims(in[kQuery].desc.dims, in[kCos].desc.dims, in[kSin].desc.dims);
            if (status != 0) return status;
        }
        return check_dims(in[kQuery].desc.dims, in[kKey].desc.dims, in[kCache].desc.dims);
    }

    int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                               int32_t nbInputs) const noexcept override {
        if (!valid_io(nbInputs, nbOutputs)) return -1;
        outputTypes[kOutput] = inputTypes[kQuery];
        outputTypes[kCacheOut] = inputTypes[kCache];
        return 0;
    }

    int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                            int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                            IExprBuilder& /*exprBuilder*/) noexcept override {
        if (!valid_io(nbInputs, nbOutputs)) return -1;
        if (inputs[kQuery].nbDims != 4 || inputs[kCache].nbDims != 5) return -1;
        // paged_attention.output_shapes: output is query-shaped, the cache keeps its shape.
        outputs[kOutput] = inputs[kQuery];
        outputs[kCacheOut] = inputs[kCache];
        return 0;
    }

    bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override {
        if (!valid_io(nbInputs, nbOutputs) || pos < 0 || pos >= nbInputs + nbOutputs) return false;
        PluginTensorDesc const& desc = inOut[pos].desc;
        if (desc.format != TensorFormat::kLINEAR) return false;
        if (pos == kQuery) return is_float(desc.type);
        if (pos == kPastLens || pos == kQueryLens || pos == kBlockTables) return desc.type == DataType::kINT32;
        return desc.type == inOut[kQuery].desc.type;   // key, value, cache, [cos, sin,] output, cache_out
    }

    size_t getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                            DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept override {
        // RoPE changes no buffer size: the workspace holds the split partials alone.
        if (nbInputs != kNumInputs && nbInputs != kNumInputsRope) return 0;
        Dims const& qmin = inputs[kQuery].min;
        Dims const& qmax = inputs[kQuery].max;
        LlmcPagedAttentionArgs args = shape_args(qmax, inputs[kCache].max, inputs[kBlockTables].max,
                                                 inputs[kQuery].desc.type);
        // The split count falls as rows grow, so the workspace need is not monotone in batch and
        // seq: take the largest over the profile's range. It is 0 once a shape fills the GPU
        // without splitting, which ends each scan early.
        size_t most = 0;
        for (int64_t s = std::max<int64_t>(qmin.d[2], 1); s <= qmax.d[2]; ++s) {
            args.seq = static_cast<int32_t>(s);
            size_t row_most = 0;
            for (int64_t b = std::max<int64_t>(qmin.d[0], 1); b <= qmax.d[0]; ++b) {
                args.batch = static_cast<int32_t>(b);
                size_t const need = llmc_paged_attention_workspace(&args);
                if (need == 0) break;
                row_most = std::max(row_most, need);
            }
            if (row_most == 0) break;
            most = std::max(most, row_most);
        }
        return most;
    }

#if LLMC_TRT_ALIASED_IO
    int32_t getAliasedInput(int32_t outputIndex) noexcept override { return outputIndex == kCacheOut ? kCache : -1; }
#endif

    // IPluginV3OneRuntime
    int32_t onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/,
                          int32_t nbOutputs) noexcept override {
        if (!valid_io(nbInputs, nbOutputs)) return fail("expects 7 inputs (9 with cos and sin) and 2 outputs");
        // enqueue is not told the input count: remember whether cos and sin are there.
        rope_ = nbInputs == kNumInputsRope;
        if (rope_) {
            int32_t const status = check_rope_dims(in[kQuery].dims, in[kCos].dims, in[kSin].dims);
            if (status != 0) return status;
        }
        return check_dims(in[kQuery].dims, in[kKey].dims, in[kCache].dims);
    }

    int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc, void const* const* inputs,
                    void* const* outputs, void* workspace, cudaStream_t stream) noexcept override {
        LlmcPagedAttentionArgs args = shape_args(inputDesc[kQuery].dims, inputDesc[kCache].dims,
                                                 inputDesc[kBlockTables].dims, inputDesc[kQuery].type);
        void* cache = outputs[kCacheOut];
        if (cache != inputs[kCache]) {
            // Aliasing not in effect: the kernels update cache_out, which must start as the pool.
            size_t bytes = 2;
            for (int32_t i = 0; i < outputDesc[kCacheOut].dims.nbDims; ++i) bytes *= outputDesc[kCacheOut].dims.d[i];
            if (cudaMemcpyAsync(cache, inputs[kCache], bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess)
                return fail("copying the cache into cache_out failed");
        }
        args.query = inputs[kQuery];
        args.key = inputs[kKey];
        args.value = inputs[kValue];
        args.cache = cache;
        args.output = outputs[kOutput];
        args.past_lens = static_cast<int32_t const*>(inputs[kPastLens]);
        args.query_lens = static_cast<int32_t const*>(inputs[kQueryLens]);
        args.block_tables = static_cast<int32_t const*>(inputs[kBlockTables]);
        if (rope_) {
            args.rope_cos = inputs[kCos];
            args.rope_sin = inputs[kSin];
            args.rotary_dim = static_cast<int32_t>(2 * inputDesc[kCos].dims.d[2]);
            args.rotary_interleaved = attrs_.rotary_interleaved;
        }
        args.workspace = workspace;
        // TensorRT allocated what getWorkspaceSize asked for at the largest shapes; sizing it
        // again here for the current ones is exact for this call.
        args.workspace_size = workspace ? llmc_paged_attention_workspace(&args) : 0;
        int const status = llmc_paged_attention(&args, stream);
        if (status == LLMC_ERR_CUDA) return fail(std::string(llmc_error_string(status)) + ": " + llmc_last_cuda_error());
        if (status != LLMC_OK) return fail(llmc_error_string(status));
        return 0;
    }

    IPluginV3* attachToContext(IPluginResourceContext* /*context*/) noexcept override { return clone(); }

    PluginFieldCollection const* getFieldsToSerialize() noexcept override { return &collection_; }

private:
    void init_fields() {
        fields_.clear();
        fields_.emplace_back("num_heads", &attrs_.num_heads, PluginFieldType::kINT32, 1);
        fields_.emplace_back("num_kv_heads", &attrs_.num_kv_heads, PluginFieldType::kINT32, 1);
        fields_.emplace_back("scale", &attrs_.scale, PluginFieldType::kFLOAT32, 1);
        fields_.emplace_back("sliding_window", &attrs_.sliding_window, PluginFieldType::kINT32, 1);
        fields_.emplace_back("softcap", &attrs_.softcap, PluginFieldType::kFLOAT32, 1);
        fields_.emplace_back("rotary_interleaved", &attrs_.rotary_interleaved, PluginFieldType::kINT32, 1);
        collection_.nbFields = static_cast<int32_t>(fields_.size());
        collection_.fields = fields_.data();
    }

    LlmcPagedAttentionArgs shape_args(Dims const& q, Dims const& cache, Dims const& tables, DataType type) const {
        LlmcPagedAttentionArgs args{};
        args.batch = static_cast<int32_t>(q.d[0]);
        args.seq = static_cast<int32_t>(q.d[2]);
        args.num_heads = attrs_.num_heads;
        args.num_kv_heads = attrs_.num_kv_heads;
        args.head_dim = static_cast<int32_t>(q.d[3]);
        args.num_blocks = static_cast<int32_t>(cache.d[1]);
        args.block_size = static_cast<int32_t>(cache.d[2]);
        args.max_blocks = static_cast<int32_t>(tables.d[1]);
        args.max_query_len = 0;   // query_lens lives on the device; S bounds it
        args.dtype = type == DataType::kBF16 ? LLMC_DTYPE_BF16 : LLMC_DTYPE_FP16;
        args.scale = attrs_.scale;
        args.softcap = attrs_.softcap;
        args.sliding_window = attrs_.sliding_window;
        return args;
    }

    // Dims may hold -1 (unknown) while building; only known values are checked.
    int32_t check_dims(Dims const& q, Dims const& k, Dims const& cache) const {
        if (q.nbDims != 4 || k.nbDims != 4 || cache.nbDims != 5) return fail("query/key must be 4-D and cache 5-D");
        auto known = [](int64_t d) { return d >= 0; };
        if (known(q.d[1]) && q.d[1] != attrs_.num_heads) return fail("query's head count differs from num_heads");
        if (known(k.d[1]) && k.d[1] != attrs_.num_kv_heads) return fail("key's head count differs from num_kv_heads");
        if (known(cache.d[3]) && cache.d[3] != attrs_.num_kv_heads) return fail("cache's head count differs from num_kv_heads");
        if (known(q.d[3]) && q.d[3] != 64 && q.d[3] != 128) return fail(llmc_error_string(LLMC_ERR_HEAD_DIM));
        if (known(q.d[3]) && known(cache.d[4]) && q.d[3] != cache.d[4]) return fail("query and cache head_dim differ");
        return 0;
    }

    // cos and sin: [B, S, R/2] with 1 <= R/2 and R <= head_dim, the same shape for both.
    static int32_t check_rope_dims(Dims const& q, Dims const& cos, Dims const& sin) {
        if (q.nbDims != 4 || cos.nbDims != 3 || sin.nbDims != 3) return fail("query must be 4-D and cos/sin 3-D");
        auto known = [](int64_t d) { return d >= 0; };
        for (int32_t i = 0; i < 3; ++i)
            if (known(cos.d[i]) && known(sin.d[i]) && cos.d[i] != sin.d[i]) return fail("cos and sin shapes differ");
        if (known(q.d[0]) && known(cos.d[0]) && cos.d[0] != q.d[0]) return fail("cos/sin batch differs from query's");
        if (known(q.d[2]) && known(cos.d[1]) && cos.d[1] != q.d[2]) return fail("cos/sin length differs from query's S");
        if (known(cos.d[2]) && cos.d[2] < 1) return fail("cos/sin last dimension (rotary_dim / 2) must be >= 1");
        if (known(q.d[3]) && known(cos.d[2]) && 2 * cos.d[2] > q.d[3])
            return fail("rotary_dim (2 * cos/sin last dimension) exceeds head_dim");
        return 0;
    }

    static int32_t fail(std::string const& msg) {
        logger().error(msg);
        return -1;
    }

    Attrs attrs_;
    bool rope_ = false;   // cos and sin inputs present (set by configurePlugin / onShapeChange)
    std::vector<PluginField> fields_;
    PluginFieldCollection collection_{};
};

class PagedAttentionCreator : public IPluginCreatorV3One {
public:
    PagedAttentionCreator() {
        fields_.emplace_back("num_heads", nullptr, PluginFieldType::kINT32, 1);
        fields_.emplace_back("num_kv_heads", nullptr, PluginFieldType::kINT32, 1);
        fields_.emplace_back("scale", nullptr, PluginFieldType::kFLOAT32, 1);
        fields_.emplace_back("sliding_window", nullptr, PluginFieldType::kINT32, 1);
        fields_.emplace_back("softcap", nullptr, PluginFieldType::kFLOAT32, 1);
        fields_.emplace_back("rotary_interleaved", nullptr, PluginFieldType::kINT32, 1);
        collection_.nbFields = static_cast<int32_t>(fields_.size());
        collection_.fields = fields_.data();
    }

    AsciiChar const* getPluginName() const noexcept override { return kPluginName; }
    AsciiChar const* getPluginVersion() const noexcept override { return kPluginVersion; }
    AsciiChar const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
    PluginFieldCollection const* getFieldNames() noexcept override { return &collection_; }

    IPluginV3* createPlugin(AsciiChar const* /*name*/, PluginFieldCollection const* fc,
                            TensorRTPhase /*phase*/) noexcept override {
        try {
            Attrs attrs;
            bool seen_heads = false, seen_kv_heads = false, seen_scale = false;
            for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
                PluginField const& f = fc->fields[i];
                if (f.name == nullptr || f.data == nullptr || f.length < 1) continue;
                if (!std::strcmp(f.name, "num_heads")) {
                    seen_heads = read_int(f, attrs.num_heads);
                } else if (!std::strcmp(f.name, "num_kv_heads")) {
                    seen_kv_heads = read_int(f, attrs.num_kv_heads);
                } else if (!std::strcmp(f.name, "sliding_window")) {
                    read_int(f, attrs.sliding_window);
                } else if (!std::strcmp(f.name, "scale")) {
                    seen_scale = read_float(f, attrs.scale);
                } else if (!std::strcmp(f.name, "softcap")) {
                    read_float(f, attrs.softcap);
                } else if (!std::strcmp(f.name, "rotary_interleaved")) {
                    read_int(f, attrs.rotary_interleaved);
                }
            }
            if (!seen_heads || !seen_kv_heads || !seen_scale) {
                logger().error("num_heads, num_kv_heads and scale are required fields");
                return nullptr;
            }
            std::string const why = attrs.invalid();
            if (!why.empty()) {
                logger().error(why);
                return nullptr;
            }
            return new PagedAttentionPlugin(attrs);
        } catch (std::exception const& e) {
            logger().error(e.what());
        }
        return nullptr;
    }

private:
    // ONNX attributes reach plugins as int32 or int64 and float32 or float64 depending on the
    // importer; accept either width rather than misread the bytes.
    static bool read_int(PluginField const& f, int32_t& out) {
        if (f.type == PluginFieldType::kINT32) out = *static_cast<int32_t const*>(f.data);
        else if (f.type == PluginFieldType::kINT64) out = static_cast<int32_t>(*static_cast<int64_t const*>(f.data));
        else return false;
        return true;
    }
    static bool read_float(PluginField const& f, float& out) {
        if (f.type == PluginFieldType::kFLOAT32) out = *static_cast<float const*>(f.data);
        else if (f.type == PluginFieldType::kFLOAT64) out = static_cast<float>(*static_cast<double const*>(f.data));
        else return false;
        return true;
    }

    std::vector<PluginField> fields_;
    PluginFieldCollection collection_{};
};

}  // namespace llmc_trt

LLMC_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) { llmc_trt::logger().set(finder); }

LLMC_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
    static llmc_trt::PagedAttentionCreator creator;
    static nvinfer1::IPluginCreatorInterface* const creators[] = {&creator};
    nbCreators = 1;
    return creators;
}
