// The CUDA backend: device memory, weight upload and the dispatch of each op to its launcher
// (backend/cuda/*.cu, kernels in kernels/). Host code only: it is compiled by the C++ compiler,
// which keeps fmt and the rest of the engine out of nvcc.
// Everything runs on one stream; copies to the host synchronise it. This first version is exact
// rather than fast: f32 activations, one warp per output row in linear, per-expert launches in
// MoE with the routing read back to the host. It is the correctness baseline that the tuned
// kernels (W4A16 tensor-core GEMM, fused MoE, flash-decoding) are tested against next to the CPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/launch.h"
#include "core/status.h"

#include <fmt/format.h>

namespace nibble {
namespace {

void check_cuda(cudaError_t err, const char* what) {
  NIBBLE_CHECK(err == cudaSuccess, "CUDA error in {}: {}", what, cudaGetErrorString(err));
}
#define CUDA_CHECK(call) check_cuda((call), #call)
#define CUDA_CHECK_LAUNCH(name) check_cuda(cudaGetLastError(), name)

cuda::Dense dense_type(WeightFormat f) {
  switch (f) {
    case WeightFormat::kF16: return cuda::Dense::kF16;
    case WeightFormat::kBF16: return cuda::Dense::kBF16;
    default: return cuda::Dense::kF32;
  }
}

class CudaBackend final : public Backend {
 public:
  CudaBackend() {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    NIBBLE_CHECK(err == cudaSuccess && count > 0, "--device cuda: no CUDA GPU is available ({})",
                 err == cudaSuccess ? "no devices" : cudaGetErrorString(err));
    CUDA_CHECK(cudaSetDevice(0));
  }
  std::string name() const override { return "cuda"; }
  std::string description() const override {
    cudaDeviceProp prop{};
    int driver = 0, runtime = 0;
    cudaGetDeviceProperties(&prop, 0);
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    return fmt::format("{} (sm_{}{}, {} SMs, {:.0f} GiB), CUDA driver {}.{}, runtime {}.{}", prop.name,
                       prop.major, prop.minor, prop.multiProcessorCount, double(prop.totalGlobalMem) / (1 << 30),
                       driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10);
  }
  double copy_bandwidth() override {
    const size_t bytes = size_t(1) << 30;
    Buffer a(*this, bytes), b(*this, bytes);
    fill_random(a.data(), DType::U8, int64_t(bytes), 0, 255, 7);
    cudaEvent_t start, stop;
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
    CUDA_CHECK(cudaMemcpy(b.data(), a.data(), bytes, cudaMemcpyDeviceToDevice));  // warm-up
    constexpr int kReps = 10;
    CUDA_CHECK(cudaEventRecord(start));
    for (int i = 0; i < kReps; ++i)
      CUDA_CHECK(cudaMemcpyAsync(i % 2 ? a.data() : b.data(), i % 2 ? b.data() : a.data(), bytes,
                                 cudaMemcpyDeviceToDevice));
    CUDA_CHECK(cudaEventRecord(stop));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return kReps * 2.0 * double(bytes) / (double(ms) / 1e3);
  }

  void* alloc(size_t bytes) override {
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 1));
    NIBBLE_CHECK(err == cudaSuccess, "out of GPU memory allocating {} bytes ({})", bytes,
                 cudaGetErrorString(err));
    return p;
  }
  void free(void* ptr) override { cudaFree(ptr); }
  void copy_to_backend(void* dst, const void* src, size_t bytes) override {
    CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  }

  LinearWeight upload(const LinearWeight& host) override {
    LinearWeight w = host;
    w.storage.clear();
    if (host.format == WeightFormat::kInt4) {
      const int64_t code_bytes = host.n * ((host.k + 1) / 2), groups = host.n * host.int4.n_groups;
      w.int4.codes = static_cast<const uint8_t*>(copy(host.int4.codes, size_t(code_bytes), w));
      w.int4.scales = static_cast<const float*>(copy(host.int4.scales, size_t(groups) * 4, w));
      w.int4.zeros = static_cast<const uint8_t*>(copy(host.int4.zeros, size_t(groups), w));
    } else {
      const size_t elem = host.format == WeightFormat::kF32 ? 4 : 2;
      w.dense = copy(host.dense, size_t(host.n * host.k) * elem, w);
    }
    if (host.bias) w.bias = static_cast<const float*>(copy(host.bias, size_t(host.n) * 4, w));
    return w;
  }
  WeightVector upload(const WeightVector& host) override {
    auto buf = std::make_shared<Buffer>(*this, size_t(host.n) * 4);
    copy_to_backend(buf->data(), host.data, size_t(host.n) * 4);
    return {buf->data(), host.n, buf};
  }

  void fill_random(void* dst, DType dtype, int64_t count, float lo, float hi, uint64_t seed) override {
    NIBBLE_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::U8,
                 "fill_random: dtype {} is not supported", dtype_name(dtype));
    cuda::fill_random(dst, dtype == DType::U8 ? 2 : dtype == DType::BF16 ? 1 : 0, count, lo, hi, seed);
    CUDA_CHECK_LAUNCH("fill_random");
  }

  void linear(const LinearWeight& w, const float* x, int64_t m, float* out) override {
    if (w.format == WeightFormat::kInt4)
      cuda::linear_int4(w.int4.codes, w.int4.scales, w.int4.zeros, w.bias, x, out, m, w.n, w.k,
                        w.int4.group_size, w.int4.n_groups);
    else
      cuda::linear_dense(dense_type(w.format), w.dense, w.bias, x, out, m, w.n, w.k);
    CUDA_CHECK_LAUNCH("linear");
  }

  void embed(const LinearWeight& table, const int32_t* ids, int64_t m, float* out) override {
    NIBBLE_CHECK(table.format != WeightFormat::kInt4, "embed: INT4 embedding tables are not supported");
    for (int64_t t = 0; t < m; ++t)
      NIBBLE_CHECK(ids[t] >= 0 && ids[t] < table.n, "token id {} is outside the vocabulary (0..{})",
                   ids[t], table.n - 1);
    Buffer dev_ids(*this, size_t(m) * 4);
    copy_to_backend(dev_ids.data(), ids, size_t(m) * 4);
    cuda::embed(dense_type(table.format), table.dense, dev_ids.data<int32_t>(), m, table.k, out);
    CUDA_CHECK_LAUNCH("embed");
  }

  void rms_norm(const float* x, const WeightVector& w, int64_t rows, int64_t dim, float eps,
                float* out) override {
    cuda::rms_norm(x, w.data, out, rows, dim, eps);
    CUDA_CHECK_LAUNCH("rms_norm");
  }

  void rope(float* x, int64_t m, int64_t n_head, int64_t head_dim, int64_t pos0,
            const RopeTable& table) override {
    cuda::rope_neox(x, table.inv_freq.data, table.attention_factor, m, n_head, head_dim, pos0);
    CUDA_CHECK_LAUNCH("rope");
  }

  void attention(const float* q, const float* k_cache, const float* v_cache, int64_t m, int64_t pos0,
                 int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale, float* out) override {
    NIBBLE_CHECK(head_dim <= cuda::kAttentionMaxHeadDim, "attention: head_dim {} exceeds {}",
                 head_dim, cuda::kAttentionMaxHeadDim);
    cuda::attention(q, k_cache, v_cache, out, m, pos0, n_head, n_head_kv, head_dim, scale);
    CUDA_CHECK_LAUNCH("attention");
  }

  void silu_mul(const float* gate, const float* up, int64_t count, float* out) override {
    cuda::silu_mul(gate, up, count, out);
    CUDA_CHECK_LAUNCH("silu_mul");
  }

  void moe_route(const float* logits, int64_t m, int64_t n_experts, int64_t top_k, bool normalize,
                 int32_t* ids, float* weights) override {
    NIBBLE_CHECK(top_k <= cuda::kMoeMaxTopK, "moe: top_k {} exceeds {}", top_k, cuda::kMoeMaxTopK);
    cuda::moe_route(logits, m, n_experts, top_k, normalize, ids, weights);
    CUDA_CHECK_LAUNCH("moe_route");
  }

  void moe(const MoeWeights& w, const float* x, int64_t m, float* out) override {
    const int64_t H = w.router.k, E = w.router.n, K = w.top_k;
    Buffer logits(*this, size_t(m * E) * 4), ids(*this, size_t(m * K) * 4), weights(*this, size_t(m * K) * 4);
    linear(w.router, x, m, logits.data());
    moe_route(logits.data(), m, E, K, w.normalize, ids.data<int32_t>(), weights.data());
    std::vector<int32_t> host_ids(size_t(m * K));
    std::vector<float> host_weights(size_t(m * K));
    copy_to_host(host_ids.data(), ids.data(), host_ids.size() * 4);
    copy_to_host(host_weights.data(), weights.data(), host_weights.size() * 4);
    CUDA_CHECK(cudaMemset(out, 0, size_t(m * H) * 4));
    std::vector<int32_t> rows;
    std::vector<float> row_weights;
    for (int64_t e = 0; e < E; ++e) {
      rows.clear();
      row_weights.clear();
      for (int64_t s = 0; s < m * K; ++s)
        if (host_ids[size_t(s)] == e) {
          rows.push_back(int32_t(s / K));
          row_weights.push_back(host_weights[size_t(s)]);
        }
      if (rows.empty()) continue;
      const MlpWeights& ex = w.experts[size_t(e)];
      const int64_t n = int64_t(rows.size()), inter = ex.gate.n;
      Buffer dev_rows(*this, size_t(n) * 4), dev_w(*this, size_t(n) * 4);
      copy_to_backend(dev_rows.data(), rows.data(), size_t(n) * 4);
      copy_to_backend(dev_w.data(), row_weights.data(), size_t(n) * 4);
      Buffer xs(*this, size_t(n * H) * 4), gate(*this, size_t(n * inter) * 4), up(*this, size_t(n * inter) * 4);
      Buffer result(*this, size_t(n * H) * 4);
      cuda::gather_rows(x, dev_rows.data<int32_t>(), n, H, xs.data());
      CUDA_CHECK_LAUNCH("gather_rows");
      linear(ex.gate, xs.data(), n, gate.data());
      linear(ex.up, xs.data(), n, up.data());
      silu_mul(gate.data(), up.data(), n * inter, gate.data());
      linear(ex.down, gate.data(), n, result.data());
      cuda::scatter_add_weighted(result.data(), dev_rows.data<int32_t>(), dev_w.data(), n, H, out);
      CUDA_CHECK_LAUNCH("scatter_add_weighted");
    }
  }

  void add(const float* x, int64_t count, float* y) override {
    cuda::add(x, count, y);
    CUDA_CHECK_LAUNCH("add");
  }

 private:
  // Copies host memory into a new device buffer owned by `w`.
  const void* copy(const void* src, size_t bytes, LinearWeight& w) {
    auto buf = std::make_shared<Buffer>(*this, bytes);
    copy_to_backend(buf->data(), src, bytes);
    w.storage.push_back(buf);
    return buf->data();
  }
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(); }

}  // namespace nibble
