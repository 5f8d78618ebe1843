// The CUDA backend: device memory, weight upload and the dispatch of each op to its launcher
// (backend/cuda/*.cu, kernels in kernels/). Host code only: it is compiled by the C++ compiler,
// which keeps fmt and the rest of the engine out of nvcc.
// Everything runs on one stream; copies to the host synchronise it. Activations are f32 between
// ops. Which kernels run: decode shapes (m <= 8 rows) take the GEMV kernels (norm and residual
// add fused, MoE in three launches, one-launch split attention, PDL); prefill shapes take the
// tensor-core GEMMs, the grouped MoE and flash attention; shapes neither supports fall back to
// the exact one-warp-per-row kernels, which are also the baseline the others were measured from.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cublaslt.h"
#include "backend/cuda/flash_attention.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/int4_layout.h"
#include "backend/cuda/kernel_trace.h"
#include "backend/cuda/launch.h"
#include "backend/pdl_trigger.h"
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

// NIBBLE_PROFILE=1: GPU time of every top-level op, from CUDA events, summed by op and printed when
// the backend is destroyed. A diagnostic (the events cost a little); `nibble bench --profile` will
// make it a report.
class OpProfiler {
 public:
  explicit OpProfiler(bool enabled) : enabled_(enabled) {}
  ~OpProfiler() {
    if (!enabled_ || records_.empty()) return;
    cudaDeviceSynchronize();
    std::unordered_map<std::string, std::pair<int64_t, double>> by_name;
    double total = 0;
    for (auto& r : records_) {
      float ms = 0;
      cudaEventElapsedTime(&ms, r.start, r.stop);
      by_name[r.name].first += 1;
      by_name[r.name].second += ms;
      total += ms;
      cudaEventDestroy(r.start);
      cudaEventDestroy(r.stop);
    }
    std::vector<std::pair<std::string, std::pair<int64_t, double>>> rows(by_name.begin(), by_name.end());
    std::sort(rows.begin(), rows.end(), [](auto& a, auto& b) { return a.second.second > b.second.second; });
    fmt::print(stderr, "\nGPU time by op (NIBBLE_PROFILE), {:.1f} ms in all:\n", total);
    for (auto& [name, v] : rows)
      fmt::print(stderr, "  {:<24} {:>8} calls {:>10.2f} ms {:>6.1f}%\n", name, v.first, v.second,
                 100 * v.second / total);
  }
  struct Scope {
    OpProfiler& p;
    bool active;
    Scope(OpProfiler& profiler, const char* name)
        : p(profiler), active(profiler.enabled_ && !profiler.paused_ && profiler.depth_++ == 0) {
      if (!active) return;
      p.records_.push_back({name, nullptr, nullptr});
      cudaEventCreate(&p.records_.back().start);
      cudaEventCreate(&p.records_.back().stop);
      cudaEventRecord(p.records_.back().start);
    }
    ~Scope() {
      if (p.enabled_ && !p.paused_) --p.depth_;
      if (active) cudaEventRecord(p.records_.back().stop);
    }
  };

 private:
  struct Record {
    std::string name;
    cudaEvent_t start, stop;
  };
  bool enabled_;
  int depth_ = 0;

 public:
  bool paused_ = false;  // while a graph is recorded (events would be recorded into it)

 private:
  std::vector<Record> records_;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend() : profiler_(std::getenv("NIBBLE_PROFILE") != nullptr) {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    NIBBLE_CHECK(err == cudaSuccess && count > 0, "--device cuda: no CUDA GPU is available ({})",
                 err == cudaSuccess ? "no devices" : cudaGetErrorString(err));
    CUDA_CHECK(cudaSetDevice(0));
    route_counter_ = Buffer(*this, sizeof(unsigned));
    CUDA_CHECK(cudaMemset(route_counter_.data(), 0, sizeof(unsigned)));
    attention_counters_ = Buffer(*this, cuda::kAttentionMaxPairs * sizeof(unsigned long long));  // split arrivals
    CUDA_CHECK(cudaMemset(attention_counters_.data(), 0, cuda::kAttentionMaxPairs * sizeof(unsigned long long)));
    argmax_counters_ = Buffer(*this, (cuda::kArgmaxMaxRows + 1) * sizeof(unsigned));  // + the head's pick
    CUDA_CHECK(cudaMemset(argmax_counters_.data(), 0, (cuda::kArgmaxMaxRows + 1) * sizeof(unsigned)));
    mxfp4_claims_ = Buffer(*this, 4 * sizeof(unsigned));
    CUDA_CHECK(cudaMemset(mxfp4_claims_.data(), 0, 4 * sizeof(unsigned)));
    post_seq_ = Buffer(*this, sizeof(unsigned));
    CUDA_CHECK(cudaMemset(post_seq_.data(), 0, sizeof(unsigned)));
    CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&post_ring_), cuda::kDecodePostRing * 8, cudaHostAllocMapped));
    std::fill(post_ring_, post_ring_ + cuda::kDecodePostRing, ~0ull);
    std::fill(std::begin(slot_post_), std::end(slot_post_), int64_t(-1));
    CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&post_ring_device_), post_ring_, 0));
    if (const char* spec = std::getenv("NIBBLE_PDL_TRIGGER")) {  // for A/B runs (backend/pdl_trigger.h)
      uint32_t bits = 0;
      std::string why_not;
      NIBBLE_CHECK(parse_pdl_trigger(spec, &bits, &why_not), "{}", why_not);
      NIBBLE_CHECK(cuda::pdl_trigger_set(bits), "NIBBLE_PDL_TRIGGER: could not set the device symbol");
    }
    if (const char* wide = std::getenv("NIBBLE_ROUTE_WIDE"); wide && std::string(wide) == "1")  // A/B runs
      NIBBLE_CHECK(cuda::route_wide_set(true), "NIBBLE_ROUTE_WIDE: could not set the device symbol");
    // NIBBLE_TIMELINE=<file>: the in-kernel timeline of the newest 2M blocks, written at exit
    // (builds configured with -DNIBBLE_TIMELINE=ON; tools/timeline.py reads it).
    if (const char* path = std::getenv("NIBBLE_TIMELINE")) {
      std::string why;
      if (cuda::timeline_start(int64_t(1) << 21, &why))
        timeline_path_ = path;
      else
        fmt::print(stderr, "NIBBLE_TIMELINE: {}\n", why);
    }
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

  ~CudaBackend() override {
    if (!timeline_path_.empty()) {
      std::string why;
      if (!cuda::timeline_dump(timeline_path_, &why)) fmt::print(stderr, "NIBBLE_TIMELINE: {}\n", why);
    }
    route_counter_ = Buffer();
    attention_counters_ = Buffer();
    argmax_counters_ = Buffer();
    mxfp4_claims_ = Buffer();
    post_seq_ = Buffer();
    if (post_ring_) cudaFreeHost(post_ring_);
    for (cudaEvent_t e : mailbox_events_)
      if (e) cudaEventDestroy(e);
    for (cudaEvent_t e : staging_events_)
      if (e) cudaEventDestroy(e);
    if (host_mailbox_) cudaFreeHost(host_mailbox_);
    if (staging_) cudaFreeHost(staging_);
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    for (auto& [size, blocks] : free_blocks_)
      for (void* p : blocks) cudaFree(p);
  }

  // A caching allocator: freed blocks are kept by size and handed out again, so the buffers of
  // each decode step cost no cudaMalloc (and no cudaFree, which synchronises the device). Reuse is
  // safe because all work runs in order on one stream. Sizes round up to 512 bytes, and past
  // 4 MiB to 1/8 of their power of two, so the varying scratch of prefill (a chunk's rows per
  // expert) falls into a few sizes. When the device is full, the cache is given back (and with
  // it the recorded graphs, which use its blocks: they are recorded again) and the
  // allocation tried once more.
  static size_t alloc_size(size_t bytes) {
    size_t size = (std::max<size_t>(bytes, 1) + 511) / 512 * 512;
    if (size > (size_t(4) << 20)) {
      size_t step = size_t(1) << 20;
      while (step * 16 < size) step *= 2;  // 1/8 .. 1/16 of the size
      size = (size + step - 1) / step * step;
    }
    return size;
  }
  void* alloc(size_t bytes) override {
    const size_t size = alloc_size(bytes);
    void* p = nullptr;
    auto& cached = free_blocks_[size];
    if (!cached.empty()) {
      p = cached.back();
      cached.pop_back();
    } else {
      cudaError_t err = cudaMalloc(&p, size);
      if (err != cudaSuccess && !capturing_) {
        cudaGetLastError();
        release_cache();
        err = cudaMalloc(&p, size);
      }
      NIBBLE_CHECK(err == cudaSuccess, "out of GPU memory allocating {} bytes ({})", bytes,
                   cudaGetErrorString(err));
    }
    block_size_[p] = size;
    return p;
  }
  void free(void* ptr) override {
    auto it = block_size_.find(ptr);
    NIBBLE_ASSERT(it != block_size_.end());
    free_blocks_[it->second].push_back(ptr);
    block_size_.erase(it);
  }
  bool memory_info(size_t* free_bytes, size_t* total_bytes) override {
    CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
    return true;
  }
  void copy_to_backend(void* dst, const void* src, size_t bytes) override {
    CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  }
  void copy_to_host(void* dst, const void* src, size_t bytes) override {
    CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  }

  // Decode pipelining: pinned host memory that copies run from and into while the host goes on,
  // each slot with the event of its last copy. The staging ring's slots are reused in turn, after
  // their last copy has run.
  void copy_to_backend_queued(void* dst, const void* src, size_t bytes) override {
    if (bytes > kStagingBytes || capturing_) return copy_to_backend(dst, src, bytes);
    ensure_host_slots();
    const int slot = staging_next_;
    staging_next_ = (staging_next_ + 1) % kStagingSlots;
    CUDA_CHECK(cudaEventSynchronize(staging_events_[slot]));
    uint8_t* host = staging_ + size_t(slot) * kStagingBytes;
    std::memcpy(host, src, bytes);
    CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, cudaStreamPerThread));
    CUDA_CHECK(cudaEventRecord(staging_events_[slot], cudaStreamPerThread));
  }
  // A one-int post of the pick the last queued advance wrote (Model::decode_enqueue's token) needs
  // no copy: that advance's kernel wrote it to the mapped ring (kernels/pick.cuh
  // decode_post) as post number posts_queued_ - 1, so the slot keeps that number and the event.
  // Other posts copy. NIBBLE_DECODE_POST_COPY=1: always copy, for A/B runs.
  void post_ints(int slot, const int32_t* src, int64_t n) override {
    check_mailbox("post_ints", slot, n);
    ensure_host_slots();
    static const bool copy = std::getenv("NIBBLE_DECODE_POST_COPY") != nullptr;
    if (!copy && n == 1 && src == last_post_src_ && posts_queued_ > 0) {
      slot_post_[slot] = posts_queued_ - 1;
    } else {
      slot_post_[slot] = -1;
      CUDA_CHECK(cudaMemcpyAsync(host_mailbox_ + slot * kMailboxInts, src, size_t(n) * 4, cudaMemcpyDeviceToHost,
                                 cudaStreamPerThread));
    }
    CUDA_CHECK(cudaEventRecord(mailbox_events_[slot], cudaStreamPerThread));
  }
  void take_ints(int slot, int32_t* dst, int64_t n) override {
    check_mailbox("take_ints", slot, n);
    ensure_host_slots();
    CUDA_CHECK(cudaEventSynchronize(mailbox_events_[slot]));
    if (const int64_t post = slot_post_[slot]; post >= 0) {
      const unsigned long long entry = reinterpret_cast<volatile unsigned long long*>(post_ring_)[post % cuda::kDecodePostRing];
      NIBBLE_CHECK(entry >> 32 == (static_cast<unsigned long long>(post) & 0xffffffffull) && n == 1,
                   "take_ints: decode post {} is not in the ring (found tag {}): the host's count of queued "
                   "posts and the device's differ", post, entry >> 32);
      dst[0] = static_cast<int32_t>(static_cast<uint32_t>(entry));
      return;
    }
    std::copy(host_mailbox_ + slot * kMailboxInts, host_mailbox_ + slot * kMailboxInts + n, dst);
  }

  LinearWeight upload(const LinearWeight& host) override {
    LinearWeight w = host;
    w.storage.clear();
    if (host.format == WeightFormat::kMxfp4) {
      // Row-major through a temporary, then the decode layout (kernels/gemv_mxfp4.cuh) on the device.
      NIBBLE_ASSERT(host.mxfp4.layout == Mxfp4Layout::kRowMajor);
      Buffer codes(*this, size_t(host.n * host.k / 2)), scales(*this, size_t(host.n * host.k / kMxfp4Block));
      copy_to_backend(codes.data(), host.mxfp4.codes, codes.bytes());
      copy_to_backend(scales.data(), host.mxfp4.scales, scales.bytes());
      w.mxfp4.codes = codes.data<uint8_t>();
      w.mxfp4.scales = scales.data<uint8_t>();
      w.bias = nullptr;  // a host pointer still: uploaded below
      w = prepare(w);
    } else if (host.format == WeightFormat::kInt4 && cuda::int4_interleavable(host.k, host.int4.group_size)) {
      const int64_t groups = host.n * host.int4.n_groups;
      cuda::Int4Interleaved il = cuda::interleave_int4(host.int4, host.n, host.k);
      w.int4.layout = Int4Layout::kWarpInterleaved;
      w.int4.codes = static_cast<const uint8_t*>(copy(il.codes.data(), il.codes.size(), w));
      w.int4.scales = static_cast<const uint16_t*>(copy(host.int4.scales, size_t(groups) * 2, w));
      w.int4.zeros = il.zeros.empty() ? nullptr : static_cast<const uint8_t*>(copy(il.zeros.data(), il.zeros.size(), w));
    } else if (host.format == WeightFormat::kInt4) {
      const int64_t code_bytes = host.n * ((host.k + 1) / 2), groups = host.n * host.int4.n_groups;
      w.int4.codes = static_cast<const uint8_t*>(copy(host.int4.codes, size_t(code_bytes), w));
      w.int4.scales = static_cast<const uint16_t*>(copy(host.int4.scales, size_t(groups) * 2, w));
      w.int4.zeros = host.int4.zeros ? static_cast<const uint8_t*>(copy(host.int4.zeros, size_t(groups), w)) : nullptr;
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
    NIBBLE_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::U8 || dtype == DType::F16,
                 "fill_random: dtype {} is not supported", dtype_name(dtype));
    const int kind = dtype == DType::U8 ? 2 : dtype == DType::BF16 ? 1 : dtype == DType::F16 ? 3 : 0;
    cuda::fill_random(dst, kind, count, lo, hi, seed);
    CUDA_CHECK_LAUNCH("fill_random");
  }

  // q, k and v in one GEMV launch: more rows in flight for the small k/v projections, two launches
  // fewer per layer. Decode-layout weights only (what the fusion is for).
  std::optional<LinearWeight> concat_rows(const std::vector<const LinearWeight*>& parts) override {
    const LinearWeight& a = *parts[0];
    if (!gemv_layout(a)) return std::nullopt;
    const bool int4 = a.format == WeightFormat::kInt4, mxfp4 = a.format == WeightFormat::kMxfp4;
    int64_t n = 0;
    for (const LinearWeight* p : parts) {
      if (p->k != a.k || p->format != a.format || !p->bias != !a.bias || !gemv_layout(*p)) return std::nullopt;
      if (int4 && (p->int4.layout != a.int4.layout || p->int4.group_size != a.int4.group_size ||
                   !p->int4.zeros != !a.int4.zeros))
        return std::nullopt;
      n += p->n;
    }
    LinearWeight w = a;
    w.name = a.name + "+";
    w.n = n;
    w.storage.clear();
    // Rows of each part, one after another, in a new buffer owned by w.
    auto cat = [&](auto field, size_t row_bytes) -> const void* {
      auto buf = std::make_shared<Buffer>(*this, size_t(n) * row_bytes);
      size_t offset = 0;
      for (const LinearWeight* p : parts) {
        const size_t bytes = size_t(p->n) * row_bytes;
        CUDA_CHECK(cudaMemcpy(buf->data<uint8_t>() + offset, field(*p), bytes, cudaMemcpyDeviceToDevice));
        offset += bytes;
      }
      w.storage.push_back(buf);
      return buf->data();
    };
    if (mxfp4) {  // the decode layout keeps each row's codes and scales apart
      w.mxfp4.codes = static_cast<const uint8_t*>(cat([](const LinearWeight& p) { return p.mxfp4.codes; }, size_t(a.k / 2)));
      w.mxfp4.scales = static_cast<const uint8_t*>(
          cat([](const LinearWeight& p) { return p.mxfp4.scales; }, size_t(cuda::mxfp4_scale_stride(a.k))));
    } else if (int4) {
      w.int4.codes = static_cast<const uint8_t*>(cat([](const LinearWeight& p) { return p.int4.codes; }, size_t(a.k / 2)));
      w.int4.scales = static_cast<const uint16_t*>(
          cat([](const LinearWeight& p) { return p.int4.scales; }, size_t(a.int4.n_groups) * 2));
      if (a.int4.zeros)
        w.int4.zeros = static_cast<const uint8_t*>(
            cat([](const LinearWeight& p) { return p.int4.zeros; }, size_t(a.int4.n_groups)));
    } else {
      const size_t elem = a.format == WeightFormat::kF32 ? 4 : 2;
      w.dense = cat([](const LinearWeight& p) { return p.dense; }, size_t(a.k) * elem);
    }
    if (a.bias) w.bias = static_cast<const float*>(cat([](const LinearWeight& p) { return p.bias; }, 4));
    return w;
  }

  LinearWeight prepare(const LinearWeight& w) override {
    if (w.format == WeightFormat::kMxfp4 && w.mxfp4.layout == Mxfp4Layout::kRowMajor) {
      NIBBLE_CHECK(w.k % kMxfp4Block == 0, "{}: MXFP4 rows of {} inputs are not whole blocks of {}", w.name, w.k,
                   kMxfp4Block);
      LinearWeight out = w;
      out.storage.clear();
      auto codes = std::make_shared<Buffer>(*this, size_t(w.n * w.k / 2));
      auto scales = std::make_shared<Buffer>(*this, size_t(w.n * cuda::mxfp4_scale_stride(w.k)));
      cuda::mxfp4_relayout(w.mxfp4.codes, w.mxfp4.scales, codes->data<uint8_t>(), scales->data<uint8_t>(), w.n, w.k);
      CUDA_CHECK_LAUNCH("mxfp4_relayout");
      out.storage = {codes, scales};  // the row-major buffers go
      if (w.bias) {
        auto bias = std::make_shared<Buffer>(*this, size_t(w.n) * 4);
        CUDA_CHECK(cudaMemcpy(bias->data(), w.bias, size_t(w.n) * 4, cudaMemcpyDeviceToDevice));
        out.bias = bias->data<float>();
        out.storage.push_back(bias);
      }
      out.mxfp4 = {codes->data<uint8_t>(), scales->data<uint8_t>(), Mxfp4Layout::kDecode};
      return out;
    }
    if (w.format != WeightFormat::kInt4 || w.int4.layout != Int4Layout::kRowMajor ||
        !cuda::int4_interleavable(w.k, w.int4.group_size))
      return w;
    // Interleave through a temporary and copy back: the codes keep their buffer (and owner).
    const size_t bytes = size_t(w.n * w.k / 2);
    Buffer interleaved(*this, bytes);
    cuda::int4_interleave(w.int4.codes, interleaved.data<uint8_t>(), w.n, w.k);
    CUDA_CHECK_LAUNCH("int4_interleave");
    CUDA_CHECK(cudaMemcpy(const_cast<uint8_t*>(w.int4.codes), interleaved.data(), bytes, cudaMemcpyDeviceToDevice));
    LinearWeight out = w;
    out.int4.layout = Int4Layout::kWarpInterleaved;
    return out;
  }

  // Prefill shapes (m > 8) on the tensor-core GEMMs where the weight qualifies; decode layouts on
  // the GEMV kernels, 8 activation rows per launch; anything else on the exact kernels.
  void linear(const LinearWeight& w, const float* x, int64_t m, float* out) override { linear(w, x, m, out, false); }
  // exact: dense weights stay on our kernels at any m (CudaBackend::gemm): the routers, and the
  // experts run one by one, whose row counts change with every batch (a library plan per count).
  void linear(const LinearWeight& w, const float* x, int64_t m, float* out, bool exact) {
    OpProfiler::Scope scope(profiler_, w.n > 100000                      ? "lm_head"
                                       : w.format == WeightFormat::kInt4  ? "linear int4"
                                       : w.format == WeightFormat::kMxfp4 ? "linear mxfp4"
                                                                          : "linear dense");
    if ((m > cuda::kGemvMaxM || dense_gemm_first(w, m)) && gemm(w, x, m, out, exact)) return;
    if (w.format == WeightFormat::kMxfp4 && m > cuda::kGemvMaxM && mxfp4_gemm(w, x, m, out)) return;
    if (!gemv_layout(w)) {
      if (w.format == WeightFormat::kInt4)
        cuda::linear_int4(w.int4.codes, w.int4.scales, w.int4.zeros, w.bias, x, out, m, w.n, w.k,
                          w.int4.group_size, w.int4.n_groups);
      else
        cuda::linear_dense(dense_type(w.format), w.dense, w.bias, x, out, m, w.n, w.k);
      CUDA_CHECK_LAUNCH("linear");
      return;
    }
    for (int64_t m0 = 0; m0 < m; m0 += cuda::kGemvMaxM)
      gemv(w, x + m0 * w.k, std::min(cuda::kGemvMaxM, m - m0), out + m0 * w.n, {});
  }

  // The fused residual-stream forms (see Backend): decode shapes on the GEMV kernels with the norm
  // in their prologue or the add in their store; everything else composes the plain ops.
  void rms_norm_linear(const float* x, const WeightVector& norm, float eps, const LinearWeight& w, int64_t m,
                       float* out) override {
    if (m > cuda::kGemvMaxM || !gemv_layout(w) || dense_gemm_first(w, m))
      return Backend::rms_norm_linear(x, norm, eps, w, m, out);
    OpProfiler::Scope scope(profiler_, w.n > 100000 ? "lm_head" : "norm+linear");
    gemv(w, x, m, out, {norm.data, eps, false});
  }

  // An MXFP4 head that the streamed kernel takes picks the token itself (cuda::gemv_mxfp4_pick):
  // one launch less a greedy decode step, ~2 µs (H100, CUPTI). In tg128 a tie for gpt-oss-20b and
  // 120b all-MXFP4 (BENCHMARKS.md: an earlier day's +2.2% and −3% did not repeat).
  // NIBBLE_HEAD_PICK=0 turns it off (cuda::head_pick_mode).
  void rms_norm_linear_pick(const float* x, const WeightVector& norm, float eps, const LinearWeight& w, float* logits,
                            int32_t* out, int32_t* ids, int32_t* positions) override {
    if (cuda::head_pick_mode() != 0 && w.format == WeightFormat::kMxfp4 && gemv_layout(w)) {
      cuda::GemvIo io{norm.data, eps, false};
      if (router_clear_) io.clear = router_clear_, io.clear_count = router_clear_count_;
      io.claim = gemv_claims();
      OpProfiler::Scope scope(profiler_, "lm_head");
      Buffer scratch(*this, size_t(cuda::gemv_mxfp4_pick_scratch_bytes()));
      cuda::GreedyPickArgs pick;
      pick.scratch = scratch.data(), pick.counter = argmax_counters() + cuda::kArgmaxMaxRows;
      pick.out = out, pick.next_ids = ids, pick.positions = positions, pick.post = decode_post(1);
      if (cuda::gemv_mxfp4_pick(w.mxfp4.codes, w.mxfp4.scales, w.bias, x, logits, w.n, w.k, io, pick)) {
        count_post(out);
        if (io.clear) router_clear_ = nullptr;
        CUDA_CHECK_LAUNCH("gemv_mxfp4_pick");
        return;
      }
    }
    Backend::rms_norm_linear_pick(x, norm, eps, w, logits, out, ids, positions);
  }

  void linear_add(const LinearWeight& w, const float* a, int64_t m, float* x) override {
    if (m > cuda::kGemvMaxM || !gemv_layout(w) || dense_gemm_first(w, m)) return Backend::linear_add(w, a, m, x);
    OpProfiler::Scope scope(profiler_, "linear+add");
    gemv(w, a, m, x, {nullptr, 0.f, true});
  }

  // Experts the fused INT4 kernels compute: SiLU·up, gate and up apart, no biases, a router without
  // a bias. gpt-oss's (biases, gate/up interleaved, clamped SwiGLU, biased router) take the
  // per-expert path, exact but through the host.
  static bool plain_moe(const MoeWeights& w) {
    return w.activation == MoeActivation::kSiluMul && !w.router.bias &&
           std::all_of(w.experts.begin(), w.experts.end(), [](const MlpWeights& e) {
             return !e.gate_up.n && !e.gate.bias && !e.up.bias && !e.down.bias;
           });
  }

  void rms_norm_moe_add(const WeightVector& norm, float eps, const MoeWeights& w, int64_t m, float* x) override {
    if (const Mxfp4Tables* tables = m <= cuda::kGemvMaxM ? mxfp4_tables(w) : nullptr) {
      Buffer normed(*this, size_t(m * w.router.k) * 4);
      OpProfiler::Scope scope(profiler_, "moe");
      if (w.router.format == WeightFormat::kInt4 || w.router.format == WeightFormat::kMxfp4 || !gemv_layout(w.router)) {
        rms_norm(x, norm, m, w.router.k, eps, normed.data());
        run_moe_mxfp4(w, *tables, normed.data(), m, x, true);
      } else {
        // The dense router GEMV normalises x itself and writes the normalised rows for the experts.
        const cuda::GemvIo router_io{norm.data, eps, false, normed.data()};
        run_moe_mxfp4(w, *tables, normed.data(), m, x, true, &router_io, x);
      }
      return;
    }
    if (!moe_decode(w, m)) return Backend::rms_norm_moe_add(norm, eps, w, m, x);
    OpProfiler::Scope scope(profiler_, "norm+moe+add");
    run_moe_decode(w, x, norm.data, eps, m, x, true);
  }

  // One token through an INT4 o projection into an INT4 MoE block with a 16-bit router: the
  // router folded into the o GEMV (its blocks add their rows' shares of the logits and of the
  // norm's Σx², kernels/moe_route.cuh RouterAcc), so the router's launch and the boundary before
  // it leave the layer's chain: Qwen3-30B-A3B INT4 tg128 +3.4% at depth 0, +1.4% at 8192, with
  // gate/up released at the o blocks' exit (H100, BENCHMARKS.md). NIBBLE_NO_ROUTER_FOLD=1: the two
  // ops, for A/B runs.
  void linear_add_rms_norm_moe_add(const LinearWeight& o, const float* a, const WeightVector& norm, float eps,
                                   const MoeWeights& w, int64_t m, float* x) override {
    static const bool off = std::getenv("NIBBLE_NO_ROUTER_FOLD") != nullptr;
    if (!off && m == 1 && o.format == WeightFormat::kMxfp4 && mxfp4_fold(o, a, norm, eps, w, x)) return;
    const ExpertTables* tables = nullptr;
    if (!off && m == 1 && o.format == WeightFormat::kInt4 && o.int4.layout == Int4Layout::kWarpInterleaved &&
        o.n == w.router.k && (w.router.format == WeightFormat::kBF16 || w.router.format == WeightFormat::kF16) &&
        moe_decode(w, m) && (tables = router_fold_sums(w)) != nullptr) {
      OpProfiler::Scope scope(profiler_, "linear+add+moe");
      flush_router_clear();  // an earlier fold's sums not yet cleared by a GEMV (these may be them)
      const cuda::RouterAcc acc{tables->fold_sums.data<unsigned long long>(), tables->fold_replicas,
                                tables->fold_stride};
      Buffer xg(*this, size_t(o.n) * 2);  // x · γ / 16, f16 in the decode mma order: gate/up's row
      if (cuda::gemv_int4_router_fold(int4_device(o), o.bias, a, x, o.n, o.k, w.router.dense,
                                      w.router.format == WeightFormat::kBF16, norm.data, w.router.n, acc, xg.data())) {
        CUDA_CHECK_LAUNCH("gemv_int4_router_fold");
        run_moe_decode(w, x, norm.data, eps, m, x, true, &acc, xg.data());
        router_clear_ = acc.sums, router_clear_count_ = int(acc.replicas * acc.stride);
        return;
      }
    }
    Backend::linear_add_rms_norm_moe_add(o, a, norm, eps, w, m, x);
  }

  // gpt-oss with an MXFP4 o projection (all-MXFP4 decode): the router folded into the o GEMV, then
  // the two streamed expert launches, which route from its sums themselves (gate/up after its
  // wait, down before its own); the next MXFP4 or INT4 GEMV zeroes the sums (router_clear_). The
  // router's launch leaves the layer's chain (gpt-oss-20b all-MXFP4 tg128 +1.2%, 120b +1.9% at
  // depth 0 with a one-block routing launch after o), and for 20b's 32 experts that routing
  // launch too (+2.8%; 120b's 128 +1.8%: cuda::fold_route_launch; H100, BENCHMARKS.md). False,
  // having launched nothing, where the shapes do not fit.
  bool mxfp4_fold(const LinearWeight& o, const float* a, const WeightVector& norm, float eps, const MoeWeights& w,
                  float* x) {
    const int64_t H = w.router.k, E = w.router.n, K = w.top_k;
    if (!gemv_layout(o) || o.n != H || !w.router.dense ||
        (w.router.format != WeightFormat::kBF16 && w.router.format != WeightFormat::kF16) ||
        K > cuda::kMoeDecodeMaxTopK)
      return false;
    auto* tables = const_cast<Mxfp4Tables*>(mxfp4_tables(w));
    if (!tables || !cuda::moe_mxfp4_streamed(tables->aligned, 1, tables->inter, H)) return false;
    if (!tables->fold_state.data()) {  // the sums, zeroed once (then after each use)
      if (capturing_) {
        capture_failed_ = true;
        return false;
      }
      Buffer state(*this, size_t(E + 1) * 8);
      CUDA_CHECK(cudaMemsetAsync(state.data(), 0, state.bytes(), cudaStreamPerThread));
      tables->fold_state = std::move(state);
    }
    OpProfiler::Scope scope(profiler_, "linear+add+moe");
    flush_router_clear();  // an earlier fold's sums not yet cleared by a GEMV (these may be them)
    const bool route_launch = cuda::fold_route_launch(E);
    Buffer xg(*this, size_t(H) * 2), ids(*this, size_t(K) * 4), weights(*this, size_t(K) * 4), scale(*this, 4);
    cuda::FoldedRouting routing;
    routing.sums = tables->fold_state.data<unsigned long long>();
    routing.bias = w.router.bias, routing.top_k = K, routing.normalize = w.normalize;
    if (route_launch)
      routing.ids = ids.data<int32_t>(), routing.weights = weights.data(), routing.scale = scale.data();
    if (!cuda::gemv_mxfp4_router_fold(o.mxfp4.codes, o.mxfp4.scales, o.bias, a, x, o.n, o.k, w.router.dense,
                                      w.router.format == WeightFormat::kBF16, norm.data, eps, E, routing, xg.data()))
      return false;
    CUDA_CHECK_LAUNCH("gemv_mxfp4_router_fold");
    Buffer act(*this, size_t(K * tables->inter) * 2);
    cuda::MoeRouting experts;
    experts.xn = xg.data(), experts.normalize = w.normalize, experts.claim = moe_claims();
    if (route_launch) {
      experts.ids = ids.data<int32_t>(), experts.weights = weights.data(), experts.x_scale = scale.data();
    } else {
      experts.acc = cuda::RouterAcc{routing.sums, 1, E + 1};
      experts.router_bias = w.router.bias, experts.eps = eps;
    }
    cuda::moe_decode_mxfp4(tables->gate_up.data<cuda::Mxfp4Device>(), tables->down.data<cuda::Mxfp4Device>(), E,
                           experts, nullptr, act.data(), x, true, 1, K, tables->inter, H, w.swiglu_alpha,
                           w.swiglu_limit, tables->aligned);
    CUDA_CHECK_LAUNCH("moe_decode_mxfp4");
    if (!route_launch) router_clear_ = routing.sums, router_clear_count_ = int(E + 1);
    return true;
  }

  // The folded router's sums wait to be zeroed for their next use: by the next INT4 decode GEMV
  // after its PDL wait (gemv's io.clear: the q/k/v projection after MoE down, whose wait is after
  // both readers), else by a memset at a capture's edge or before the next fold (a BF16 lm_head
  // after the last layer leaves them to the end of the step's graph, or to the next step's first
  // q/k/v when not recording).
  unsigned long long* router_clear_ = nullptr;
  int router_clear_count_ = 0;
  void flush_router_clear() {
    if (!router_clear_) return;
    CUDA_CHECK(cudaMemsetAsync(router_clear_, 0, size_t(router_clear_count_) * 8, cudaStreamPerThread));
    router_clear_ = nullptr;
  }

  void embed(const LinearWeight& table, const int32_t* ids, int64_t m, float* out) override {
    OpProfiler::Scope scope(profiler_, "embed");
    NIBBLE_CHECK(table.format != WeightFormat::kInt4, "embed: INT4 embedding tables are not supported");
    cuda::embed(dense_type(table.format), table.dense, ids, m, table.k, out);
    CUDA_CHECK_LAUNCH("embed");
  }

  void rms_norm(const float* x, const WeightVector& w, int64_t rows, int64_t dim, float eps,
                float* out) override {
    OpProfiler::Scope scope(profiler_, "rms_norm");
    NIBBLE_CHECK(dim <= cuda::kNormMaxDim, "rms_norm: dim {} exceeds {}", dim, cuda::kNormMaxDim);
    cuda::rms_norm(x, nullptr, nullptr, w.data, out, rows, dim, eps);
    CUDA_CHECK_LAUNCH("rms_norm");
  }

  void add_rms_norm(const float* delta, float* x, const WeightVector& w, int64_t rows, int64_t dim,
                    float eps, float* out) override {
    OpProfiler::Scope scope(profiler_, "add_rms_norm");
    NIBBLE_CHECK(dim <= cuda::kNormMaxDim, "rms_norm: dim {} exceeds {}", dim, cuda::kNormMaxDim);
    cuda::rms_norm(x, delta, x, w.data, out, rows, dim, eps);
    CUDA_CHECK_LAUNCH("add_rms_norm");
  }

  void qk_norm_rope_kv_write(const float* q_in, float* q_out, int64_t q_stride, const float* k_new,
                             const float* v_new, int64_t kv_stride, const WeightVector& q_norm,
                             const WeightVector& k_norm, float eps, const RopeTable& rope,
                             const int32_t* positions, int64_t m, int64_t n_head, int64_t n_head_kv,
                             int64_t head_dim, const KvPages& kv) override {
    OpProfiler::Scope scope(profiler_, "qk_norm_rope_kv");
    NIBBLE_CHECK(head_dim <= 2 * 32 * 8 && head_dim % 2 == 0, "attention: head_dim {} is not supported",
                 head_dim);
    cuda::qk_norm_rope_kv_write(q_in, q_out, q_stride, k_new, v_new, kv_stride, q_norm.data, k_norm.data, eps,
                                rope.inv_freq.data,
                                rope.attention_factor, positions, m, n_head, n_head_kv, head_dim, kv);
    CUDA_CHECK_LAUNCH("qk_norm_rope_kv_write");
  }

  // The prologue inside the tensor-core decode attention (kernels/attention.cuh AttentionPrologue):
  // one launch and one kernel boundary less per layer. NIBBLE_NO_FUSED_ROPE=1: the two launches,
  // for A/B runs.
  void qk_norm_rope_attention(const float* q_in, int64_t q_stride, const float* k_new, const float* v_new,
                              int64_t kv_stride, const WeightVector& q_norm, const WeightVector& k_norm, float eps,
                              const RopeTable& rope, const int32_t* positions, int64_t m, int64_t n_head,
                              int64_t n_head_kv, int64_t head_dim, const KvPages& kv, int64_t max_context,
                              float scale, float* q_scratch, float* out, const float* sinks,
                              int64_t window) override {
    static const bool off = std::getenv("NIBBLE_NO_FUSED_ROPE") != nullptr;
    if (!off && m <= cuda::kGemvMaxM &&
        cuda::attention_decode_supports(m, n_head, n_head_kv, head_dim, kv.dtype) && kv.dtype != DType::F32) {
      OpProfiler::Scope scope(profiler_, "attention");
      const cuda::AttentionPrologue pro{q_in, q_stride, k_new, v_new, kv_stride, q_norm.data, k_norm.data,
                                        eps,  rope.inv_freq.data, rope.attention_factor};
      decode_attention(nullptr, kv, m, positions, max_context, n_head, n_head_kv, head_dim, scale, out, sinks, window,
                       &pro);
      CUDA_CHECK_LAUNCH("attention_decode (fused prologue)");
      return;
    }
    Backend::qk_norm_rope_attention(q_in, q_stride, k_new, v_new, kv_stride, q_norm, k_norm, eps, rope, positions, m,
                                    n_head, n_head_kv, head_dim, kv, max_context, scale, q_scratch, out, sinks, window);
  }

  // Decode attention: the context split across blocks (flash-decoding), merged by the last split
  // block; with `prologue`, q/k norm, RoPE and the KV write inside it. The shapes must be ones
  // cuda::attention_decode_supports (and, with a prologue, a 16-bit or FP8 cache).
  void decode_attention(const float* q, const KvPages& kv, int64_t m, const int32_t* positions, int64_t max_context,
                        int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale, float* out,
                        const float* sinks, int64_t window, const cuda::AttentionPrologue* prologue = nullptr) {
    Buffer partial(*this, size_t(cuda::attention_partial_floats(m, max_context, n_head, head_dim)) * 4);
    const bool launched =
        cuda::attention_decode(q, kv, partial.data(), out, attention_counters_.data<unsigned long long>(), m, positions,
                               max_context, n_head, n_head_kv, head_dim, scale, sinks, window, prologue);
    NIBBLE_CHECK(launched, "decode attention declined a supported shape");
  }

  void attention(const float* q, const KvPages& kv, int64_t m, const int32_t* positions, int64_t max_context,
                 int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale, float* out, const float* sinks,
                 int64_t window) override {
    OpProfiler::Scope scope(profiler_, "attention");
    NIBBLE_CHECK(head_dim <= cuda::kAttentionMaxHeadDim, "attention: head_dim {} exceeds {}",
                 head_dim, cuda::kAttentionMaxHeadDim);
    unsigned long long* counters = attention_counters_.data<unsigned long long>();
    if (m <= cuda::kGemvMaxM && cuda::attention_decode_supports(m, n_head, n_head_kv, head_dim, kv.dtype)) {
      decode_attention(q, kv, m, positions, max_context, n_head, n_head_kv, head_dim, scale, out, sinks, window);
    } else if (m > cuda::kGemvMaxM && cuda::flash_attention(q, kv, out, m, positions, n_head, n_head_kv, head_dim,
                                                              scale, sinks, window)) {
      // Prefill on the tensor cores (head_dim 64/128, GQA group <= 8, 16-byte-aligned pointers):
      // each staged K/V tile serves a block's 128 (token, q head) rows. f16 operands, f32 sums;
      // gpt-oss's sinks and sliding windows included (a window's block stages only its tiles).
    } else if (const int64_t chunk = std::min<int64_t>(256, cuda::kAttentionMaxPairs / n_head_kv);
               m > cuda::kGemvMaxM && chunk >= 1 &&
               cuda::attention_decode_supports(chunk, n_head, n_head_kv, head_dim, kv.dtype)) {
      // Prefill with the decode kernel, a chunk of query tokens per launch (bounds the split
      // partials): every (token, kv head, split) is a block, so a long prompt fills the GPU. The
      // fallback for shapes the flash-attention kernel does not take.
      Buffer partial(*this, size_t(cuda::attention_partial_floats(chunk, max_context, n_head, head_dim)) * 4);
      for (int64_t t0 = 0; t0 < m; t0 += chunk) {
        KvPages pages = kv;
        if (pages.seq_rows) pages.seq_rows += t0;
        cuda::attention_decode(q + t0 * n_head * head_dim, pages, partial.data(), out + t0 * n_head * head_dim, counters,
                               std::min(chunk, m - t0), positions + t0, max_context, n_head, n_head_kv, head_dim,
                               scale, sinks, window);
      }
    } else {
      cuda::attention(q, kv, out, m, positions, n_head, n_head_kv, head_dim, scale, sinks, window);
    }
    CUDA_CHECK_LAUNCH("attention");
  }

  void silu_mul(const float* gate, const float* up, int64_t count, float* out) override {
    OpProfiler::Scope scope(profiler_, "silu_mul");
    cuda::silu_mul(gate, up, count, out);
    CUDA_CHECK_LAUNCH("silu_mul");
  }

  void moe_route(const float* logits, int64_t m, int64_t n_experts, int64_t top_k, bool normalize,
                 int32_t* ids, float* weights) override {
    OpProfiler::Scope scope(profiler_, "moe_route");
    NIBBLE_CHECK(top_k <= cuda::kMoeMaxTopK && n_experts <= cuda::kMoeMaxExperts,
                 "moe: top_k {} / {} experts exceed the kernel's limits ({} / {})", top_k, n_experts,
                 cuda::kMoeMaxTopK, cuda::kMoeMaxExperts);
    cuda::moe_route(logits, m, n_experts, top_k, normalize, ids, weights);
    CUDA_CHECK_LAUNCH("moe_route");
  }

  void moe(const MoeWeights& w, const float* x, int64_t m, float* out) override {
    OpProfiler::Scope scope(profiler_, "moe");
    if (moe_decode(w, m)) {
      run_moe_decode(w, x, nullptr, 0.f, m, out, false);
      return;
    }
    if (m <= cuda::kGemvMaxM) {
      if (const Mxfp4Tables* tables = mxfp4_tables(w)) {
        run_moe_mxfp4(w, *tables, x, m, out, false);
        return;
      }
    }
    const int64_t H = w.router.k, E = w.router.n, K = w.top_k;
    Buffer logits(*this, size_t(m * E) * 4), ids(*this, size_t(m * K) * 4), weights(*this, size_t(m * K) * 4);
    linear(w.router, x, m, logits.data(), /*exact=*/true);
    moe_route(logits.data(), m, E, K, w.normalize, ids.data<int32_t>(), weights.data());
    if (const Mxfp4Tables* tables = mxfp4_tables(w); tables && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
      // gpt-oss prefill: the same device-side grouping, grouped MXFP4 GEMMs (SwiGLU in the
      // gate/up epilogue); no host round trip, no BF16 copies of the experts.
      Buffer scratch(*this, size_t(cuda::moe_prefill_scratch_bytes(m, K, E, tables->inter, H)));
      cuda::moe_prefill_mxfp4(tables->gate_up.data<cuda::Mxfp4Device>(), tables->down.data<cuda::Mxfp4Device>(),
                              ids.data<int32_t>(), weights.data(), x, out, m, K, E, tables->inter, H, w.swiglu_alpha,
                              w.swiglu_limit, tables->fold_scales, scratch.data());
      CUDA_CHECK_LAUNCH("moe_prefill_mxfp4");
      return;
    }
    if (const ExpertTables* tables = plain_moe(w) ? expert_tables(w) : nullptr;
        tables && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
      // Prefill: the pairs are grouped by expert on the device and run as grouped tensor-core GEMMs;
      // no host round trip, so it can be recorded too.
      const int64_t inter = w.experts[0].gate.n;
      Buffer scratch(*this, size_t(cuda::moe_prefill_scratch_bytes(m, K, E, inter, H)));
      cuda::moe_prefill_int4(tables->gate.data<cuda::Int4Device>(), tables->up.data<cuda::Int4Device>(),
                             tables->down.data<cuda::Int4Device>(), ids.data<int32_t>(), weights.data(), x, out, m,
                             K, E, inter, H, scratch.data());
      CUDA_CHECK_LAUNCH("moe_prefill_int4");
      return;
    }
    // Other experts (BF16, row-major INT4, MXFP4 at an unaligned x): per expert, through the host.
    if (capturing_) {  // the grouped path reads the routing back to the host: not recordable
      capture_failed_ = true;
      return;
    }
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
      const int64_t n = int64_t(rows.size()), inter = ex.inter();
      Buffer dev_rows(*this, size_t(n) * 4), dev_w(*this, size_t(n) * 4);
      copy_to_backend(dev_rows.data(), rows.data(), size_t(n) * 4);
      copy_to_backend(dev_w.data(), row_weights.data(), size_t(n) * 4);
      Buffer xs(*this, size_t(n * H) * 4), gate(*this, size_t(n * inter) * 4), up(*this, size_t(n * inter) * 4);
      Buffer result(*this, size_t(n * H) * 4);
      cuda::gather_rows(x, dev_rows.data<int32_t>(), n, H, xs.data());
      CUDA_CHECK_LAUNCH("gather_rows");
      if (ex.gate_up.n) {  // gpt-oss: one projection, rows gate_j, up_j interleaved
        Buffer both(*this, size_t(n * 2 * inter) * 4);
        linear(ex.gate_up, xs.data(), n, both.data(), true);
        NIBBLE_CHECK(w.activation == MoeActivation::kClampedSwiglu,
                     "moe: interleaved gate/up needs the clamped SwiGLU");
        cuda::clamped_swiglu_interleaved(both.data(), n, inter, w.swiglu_alpha, w.swiglu_limit, gate.data());
        CUDA_CHECK_LAUNCH("clamped_swiglu_interleaved");
      } else {
        NIBBLE_CHECK(w.activation == MoeActivation::kSiluMul, "moe: the clamped SwiGLU needs interleaved gate/up");
        linear(ex.gate, xs.data(), n, gate.data(), true);
        linear(ex.up, xs.data(), n, up.data(), true);
        silu_mul(gate.data(), up.data(), n * inter, gate.data());
      }
      linear(ex.down, gate.data(), n, result.data(), true);
      cuda::scatter_add_weighted(result.data(), dev_rows.data<int32_t>(), dev_w.data(), n, H, out);
      CUDA_CHECK_LAUNCH("scatter_add_weighted");
    }
  }

  bool start_trace(std::string* why_not) override {
    CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    return cuda::kernel_trace_start(why_not);
  }
  std::vector<KernelSpan> stop_trace() override {
    CUDA_CHECK(cudaDeviceSynchronize());
    return cuda::kernel_trace_stop();
  }

  bool supports_graphs() const override { return true; }

  void begin_capture(uint64_t key) override {
    NIBBLE_ASSERT(!capturing_);
    // Not while queued steps (Model::decode_enqueue) run: the capture records only new work, but a
    // first recording may build tables with copies that would wait on them mid-capture.
    flush_router_clear();
    CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    CUDA_CHECK(cudaStreamBeginCapture(cudaStreamPerThread, cudaStreamCaptureModeRelaxed));
    capturing_ = true;
    capture_failed_ = false;
    capture_posts_ = 0;
    profiler_.paused_ = true;
  }

  bool end_capture(uint64_t key) override {
    flush_router_clear();  // recorded: the graph's step leaves the sums zero
    capturing_ = false;
    profiler_.paused_ = false;
    cudaGraph_t graph = nullptr;
    const cudaError_t err = cudaStreamEndCapture(cudaStreamPerThread, &graph);
    if (err != cudaSuccess || capture_failed_ || !graph) {
      cudaGetLastError();  // clear the capture error; the caller runs the step uncaptured
      if (graph) cudaGraphDestroy(graph);
      return false;
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (inst != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    graphs_[key] = exec;
    graph_posts_[key] = capture_posts_;
    return true;
  }

  // Frees the cached blocks and the graphs that may use them.
  void release_cache() {
    CUDA_CHECK(cudaDeviceSynchronize());
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    graphs_.clear();
    graph_posts_.clear();
    for (auto& [size, blocks] : free_blocks_)
      for (void* p : blocks) CUDA_CHECK(cudaFree(p));
    free_blocks_.clear();
  }

  void drop_graph(uint64_t key) override {
    auto it = graphs_.find(key);
    if (it == graphs_.end()) return;
    cudaStreamSynchronize(cudaStreamPerThread);  // not while a launch may run; no throw: called from destructors
    cudaGraphExecDestroy(it->second);
    graphs_.erase(it);
    graph_posts_.erase(key);
  }
  size_t graph_count() const override { return graphs_.size(); }

  bool replay(uint64_t key) override {
    auto it = graphs_.find(key);
    if (it == graphs_.end()) return false;
    OpProfiler::Scope scope(profiler_, "graph step");
    CUDA_CHECK(cudaGraphLaunch(it->second, cudaStreamPerThread));
    posts_queued_ += graph_posts_[key];
    return true;
  }

  void advance_decode(const int32_t* picked, int64_t n, int32_t* ids, int32_t* positions) override {
    OpProfiler::Scope scope(profiler_, "advance_decode");
    cuda::advance_decode(picked, n, ids, positions, decode_post(n));
    if (n == 1) count_post(picked);
    CUDA_CHECK_LAUNCH("advance_decode");
  }

  void argmax(const float* x, int64_t rows, int64_t n, int32_t* out) override {
    OpProfiler::Scope scope(profiler_, "argmax");
    Buffer scratch(*this, size_t(cuda::argmax_scratch_bytes(rows)));
    cuda::argmax(x, rows, n, out, scratch.data(), argmax_counters());
    CUDA_CHECK_LAUNCH("argmax");
  }
  void argmax_advance_decode(const float* x, int64_t rows, int64_t n, int32_t* out, int32_t* ids,
                             int32_t* positions) override {
    bool advanced = false;
    {
      OpProfiler::Scope scope(profiler_, "argmax");
      Buffer scratch(*this, size_t(cuda::argmax_scratch_bytes(rows)));
      advanced = cuda::argmax(x, rows, n, out, scratch.data(), argmax_counters(), ids, positions,
                              decode_post(rows));
      if (advanced && rows == 1) count_post(out);  // else advance_decode below posts it
      CUDA_CHECK_LAUNCH("argmax");
    }
    if (!advanced) advance_decode(out, rows, ids, positions);
  }

  void apply_penalties(float* logits, int64_t n, const PenaltyRow* rows, int64_t n_rows,
                       const PenaltyToken* tokens) override {
    OpProfiler::Scope scope(profiler_, "penalties");
    cuda::apply_penalties(logits, n, rows, n_rows, tokens);
    CUDA_CHECK_LAUNCH("penalties");
  }

  void sample(const float* x, int64_t n, const SampleInputs* in, int32_t* out) override {
    OpProfiler::Scope scope(profiler_, "sample");
    NIBBLE_CHECK(n <= cuda::kSampleMaxVocab, "sample: a vocabulary of {} exceeds {}", n, cuda::kSampleMaxVocab);
    Buffer scratch(*this, size_t(cuda::sample_scratch_bytes(n)));
    cuda::sample(x, n, in, out, scratch.data());
    CUDA_CHECK_LAUNCH("sample");
  }

  void add(const float* x, int64_t count, float* y) override {
    OpProfiler::Scope scope(profiler_, "add");
    cuda::add(x, count, y);
    CUDA_CHECK_LAUNCH("add");
  }

 private:
  // Whether w is in a layout the decode GEMV kernels read (interleaved INT4, or dense rows whose
  // length is a whole number of 16-byte vectors per lane).
  // An lm_head-sized 16-bit weight with 4 to 8 rows goes to the tensor-core GEMM, not the GEMV: the
  // dense GEMV reads the weight once but does every row's products on the CUDA cores with x from
  // shared memory, so its time grows with the rows (BF16 lm_head of Qwen3-30B-A3B on an H100: 214
  // µs at 1 row, 1000 µs at 8), while the GEMM's stays near the weight's bandwidth time. Measured
  // (BENCHMARKS.md, `nibble bench --batch`): the INT4 model with its BF16 head +2.5% at 4 rows,
  // +5.6% at 8, -2% at 2 when tried; every dense weight of the BF16 model through the GEMM from 2
  // rows lost 15-35% (smaller matrices: the GEMM's fixed cost dominates), hence both bounds.
  static bool dense_gemm_first(const LinearWeight& w, int64_t m) {
    return m >= 4 && w.format != WeightFormat::kInt4 && w.format != WeightFormat::kMxfp4 &&
           w.n * w.k >= (int64_t(1) << 27) &&
           cuda::gemm_dense_supports(dense_type(w.format), w.k);
  }

  static bool gemv_layout(const LinearWeight& w) {
    if (w.format == WeightFormat::kMxfp4) return w.mxfp4.layout == Mxfp4Layout::kDecode;  // always, once uploaded
    return w.format == WeightFormat::kInt4 ? w.int4.layout == Int4Layout::kWarpInterleaved
                                           : w.k % cuda::dense_per_vec(dense_type(w.format)) == 0;
  }

  // MXFP4 with prefill shapes: dequantised to BF16 (exactly) into scratch, then a dense
  // tensor-core GEMM (cuBLASLt's above library_gemm_min_rows() rows, as gemm()). Writing and reading
  // the BF16 copy costs 4x the weight's own bytes, a small part of a prefill's time (gpt-oss's
  // q/k/v, o and lm_head when quantized at load; its experts take the grouped MXFP4 GEMMs of moe()).
  bool mxfp4_gemm(const LinearWeight& w, const float* x, int64_t m, float* out) {
    if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || !cuda::gemm_dense_supports(cuda::Dense::kBF16, w.k)) return false;
    Buffer dense(*this, size_t(w.n * w.k) * 2);
    cuda::mxfp4_dequant_bf16(w.mxfp4.codes, w.mxfp4.scales, dense.data(), w.n, w.k);
    CUDA_CHECK_LAUNCH("mxfp4_dequant_bf16");
    LinearWeight bf16 = w;
    bf16.format = WeightFormat::kBF16;
    bf16.dense = dense.data();
    if (!(m > library_gemm_min_rows() && library_gemm(bf16, x, m, out)))
      cuda::gemm_dense(cuda::Dense::kBF16, dense.data(), w.bias, x, out, m, w.n, w.k);
    CUDA_CHECK_LAUNCH("gemm");
    return true;
  }

  void gemv(const LinearWeight& w, const float* x, int64_t m, float* out, cuda::GemvIo io) {
    if (router_clear_ && (w.format == WeightFormat::kInt4 || w.format == WeightFormat::kMxfp4)) {
      io.clear = router_clear_, io.clear_count = router_clear_count_;
      router_clear_ = nullptr;
    }
    if (w.format == WeightFormat::kMxfp4) {
      io.claim = gemv_claims();
      cuda::gemv_mxfp4(w.mxfp4.codes, w.mxfp4.scales, w.bias, x, out, m, w.n, w.k, io);
    } else if (w.format == WeightFormat::kInt4) {
      cuda::gemv_int4(int4_device(w), w.bias, x, out, m, w.n, w.k, io);
    } else {
      cuda::gemv_dense(dense_type(w.format), w.dense, w.bias, x, out, m, w.n, w.k, io);
    }
    CUDA_CHECK_LAUNCH("gemv");
  }

  // The fused MoE decode: the router's logits in one launch, then gate/up (+SiLU) and down (+the
  // routing-weighted sum, + the residual when accumulate) over all selected experts in one launch
  // each, routing for themselves. Needs interleaved INT4 experts and a router in a GEMV layout
  // (16-bit, or 4-bit from --quantize-layers router).
  bool moe_decode(const MoeWeights& w, int64_t m) {
    return m <= cuda::kGemvMaxM && w.top_k <= cuda::kMoeDecodeMaxTopK && w.router.n <= cuda::kMoeMaxExperts &&
           m * w.router.k * 4 <= cuda::kMoeRouterMaxStagedBytes && gemv_layout(w.router) && plain_moe(w) &&
           expert_tables(w);
  }
  static bool four_bit(const LinearWeight& w) {
    return w.format == WeightFormat::kInt4 || w.format == WeightFormat::kMxfp4;
  }
  // Copies of the router's logits for the INT4 expert kernels: Qwen3-30B-A3B's 384 gate/up blocks
  // and 128 down blocks read one token's 512 bytes of logits at once; block b reads copy b mod 8
  // (+0.1-0.8% tg128 in three A/B runs, BENCHMARKS.md). NIBBLE_MOE_LOGIT_REPLICAS=n (1..32) for A/B.
  static constexpr int kMoeLogitReplicas = 8;
  void run_moe_decode(const MoeWeights& w, const float* x, const float* norm, float eps, int64_t m, float* out,
                      bool accumulate, const cuda::RouterAcc* folded = nullptr, const void* folded_row = nullptr) {
    const ExpertTables* tables = expert_tables(w);
    const int64_t H = w.router.k, E = w.router.n, K = w.top_k, inter = w.experts[0].gate.n;
    // Copies of the logits, each on lines of its own (cuda::MoeRouting::logit_replicas).
    static const int replicas = [] {
      const char* env = std::getenv("NIBBLE_MOE_LOGIT_REPLICAS");
      return env ? std::clamp(std::atoi(env), 1, 32) : kMoeLogitReplicas;
    }();
    const int64_t replica_stride = (m * E + 31) / 32 * 32;
    Buffer logits(*this, size_t(replicas * replica_stride) * 4), ids(*this, size_t(m * K) * 4),
        weights(*this, size_t(m * K) * 4);
    Buffer act(*this, size_t(m * K * inter) * 2);  // f16, in the decode mma order
    Buffer xn(*this, size_t(m * H) * 2);             // the normalised rows, f16, staged by the router
    // The router writes only logits and the expert kernels route for themselves (one warp's arg-max
    // rounds each, instead of a cross-block meeting on the critical path). NIBBLE_MOE_ROUTER_ROUTES=1:
    // the router routes (a thread-block cluster), as before, for A/B runs.
    static const bool router_routes = std::getenv("NIBBLE_MOE_ROUTER_ROUTES") != nullptr;
    // NIBBLE_MOE_ROUTE_LAUNCH=1: the logits-only router, then a routing launch whose ids and
    // weights the expert kernels read, as the MXFP4 path does; measured 4% slower at depth 0 and
    // 7% at 8192 (its one-block routing kernel on the critical path), kept for A/B runs.
    static const bool route_launch = std::getenv("NIBBLE_MOE_ROUTE_LAUNCH") != nullptr;
    cuda::MoeRouting routing;
    if (folded) {  // the o projection made the router's sums and gate/up's row
      routing.acc = *folded, routing.normalize = w.normalize, routing.xn = folded_row;
    } else if (four_bit(w.router)) {
      // A 4-bit router: the decode GEMV normalises x, writes the logits (its activations in f16,
      // as every 4-bit product's) and, INT4, its staged rows for gate/up.
      const bool staged = w.router.format == WeightFormat::kInt4 && H % 8 == 0;
      gemv(w.router, x, m, logits.data(), {norm, eps, false, nullptr, staged ? xn.data() : nullptr});
      if (staged) routing.xn = xn.data();
      routing.logits = logits.data(), routing.normalize = w.normalize;
    } else if (router_routes) {
      cuda::moe_router(dense_type(w.router.format), w.router.dense, x, m, E, H, norm, eps, logits.data(), K,
                       w.normalize, ids.data<int32_t>(), weights.data(), route_counter_.data<unsigned>());
      routing.ids = ids.data<int32_t>(), routing.weights = weights.data();
    } else {
      const int copies = route_launch ? 1 : replicas;
      if (cuda::moe_router_logits(dense_type(w.router.format), w.router.dense, x, m, E, H, norm, eps, logits.data(),
                                  xn.data(), copies, replica_stride))
        routing.xn = xn.data();
      if (route_launch) {
        moe_route(logits.data(), m, E, K, w.normalize, ids.data<int32_t>(), weights.data());
        routing.ids = ids.data<int32_t>(), routing.weights = weights.data();
      } else {
        routing.logits = logits.data(), routing.normalize = w.normalize;
        routing.logit_replicas = copies, routing.replica_stride = replica_stride;
      }
    }
    CUDA_CHECK_LAUNCH("moe_router");
    cuda::moe_decode_int4(tables->gate.data<cuda::Int4Device>(), tables->up.data<cuda::Int4Device>(),
                          tables->down.data<cuda::Int4Device>(), E, tables->group_shift, routing, x, norm, eps,
                          act.data(), out, accumulate, m, K, inter, H);
    CUDA_CHECK_LAUNCH("moe_decode_int4");
  }

  // Prefill-shaped linears (m > kGemvMaxM) on the tensor cores: interleaved INT4 (f16 activations)
  // and F16/BF16 (near-f32 split activations). False where the weight or x does not qualify.
  // Dense weights with more than library_gemm_min_rows() rows go to cuBLASLt with the same split (its
  // Hopper kernels: gpt-oss-20b's q/k/v and o took 27.6 of a pp2048's 106 ms on ours, H100,
  // BENCHMARKS.md), except with `exact`: the router, whose logits pick the experts, stays on our
  // kernel, which also bounds the tensor cores' truncating f32 accumulation (gemm_dense.cuh).
  // From 9 rows (where the GEMVs stop): a 16-token prefill of gpt-oss-20b spent 5.3 of its 13.5 ms
  // in our kernel's 72 dense projections (73 µs each, H100). NIBBLE_LIBRARY_GEMM_MIN_ROWS=N moves
  // the bound, for A/B runs.
  static int64_t library_gemm_min_rows() {
    static const int64_t rows = [] {
      const char* env = std::getenv("NIBBLE_LIBRARY_GEMM_MIN_ROWS");
      return env ? std::max<int64_t>(std::atoll(env), cuda::kGemvMaxM) : cuda::kGemvMaxM;
    }();
    return rows;
  }
  bool gemm(const LinearWeight& w, const float* x, int64_t m, float* out, bool exact = false) {
    if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || w.format == WeightFormat::kMxfp4) return false;
    if (w.format == WeightFormat::kInt4) {
      if (w.int4.layout != Int4Layout::kWarpInterleaved) return false;
      cuda::gemm_int4(int4_device(w), w.bias, x, out, m, w.n, w.k);
    } else if (!exact && m > library_gemm_min_rows() && library_gemm(w, x, m, out)) {
      // done by cuBLASLt
    } else if (cuda::gemm_dense_supports(dense_type(w.format), w.k)) {
      cuda::gemm_dense(dense_type(w.format), w.dense, w.bias, x, out, m, w.n, w.k);
    } else {
      return false;
    }
    CUDA_CHECK_LAUNCH("gemm");
    return true;
  }

  bool library_gemm(const LinearWeight& w, const float* x, int64_t m, float* out) {
    if (w.format == WeightFormat::kF32 || w.k % 8 != 0 || reinterpret_cast<uintptr_t>(w.dense) % 16 != 0) return false;
    Buffer split(*this, size_t(2 * m * w.k) * 2);  // x's hi and lo halves
    return cuda::cublaslt_gemm_split(dense_type(w.format), w.dense, w.bias, x, out, m, w.n, w.k, split.data());
  }

  static cuda::Int4Device int4_device(const LinearWeight& w) {
    return {w.int4.codes, w.int4.scales, w.int4.zeros, cuda::int4_group_shift(w.k, w.int4.group_size),
            w.int4.n_groups};
  }

  // gpt-oss's MXFP4 experts as device arrays for the decode kernels (kernels/moe_mxfp4.cuh),
  // built on first use and kept in the weights' backend_state (plain_moe weights keep
  // ExpertTables there instead). Null when the experts are not all MXFP4 of gpt-oss's layout.
  struct Mxfp4Tables {
    bool usable = false;
    bool fold_scales = false;  // every scale in the prefill kernels' f16 folding range
    bool aligned = true;       // every matrix's codes and scales 16-byte aligned (streamed decode)
    int64_t inter = 0;
    Buffer gate_up, down;
    Buffer fold_state;  // the folded router's sums (mxfp4_fold), made on first use
  };
  const Mxfp4Tables* mxfp4_tables(const MoeWeights& w) {
    if (plain_moe(w) || w.activation != MoeActivation::kClampedSwiglu) return nullptr;
    if (w.backend_state) {
      const auto* tables = static_cast<const Mxfp4Tables*>(w.backend_state.get());
      return tables->usable ? tables : nullptr;
    }
    if (capturing_) {  // building them copies from the host: not while recording
      capture_failed_ = true;
      return nullptr;
    }
    auto tables = std::make_shared<Mxfp4Tables>();
    w.backend_state = tables;
    const int64_t H = w.router.k;
    tables->inter = w.experts.empty() ? 0 : w.experts[0].inter();
    std::vector<cuda::Mxfp4Device> gate_up, down;
    for (const MlpWeights& e : w.experts) {
      if (e.gate_up.format != WeightFormat::kMxfp4 || e.down.format != WeightFormat::kMxfp4 ||
          !gemv_layout(e.gate_up) || !gemv_layout(e.down) || e.gate_up.n != 2 * tables->inter ||
          e.gate_up.k != H || e.down.n != H || e.down.k != tables->inter)
        return nullptr;
      gate_up.push_back({e.gate_up.mxfp4.codes, e.gate_up.mxfp4.scales, e.gate_up.bias});
      down.push_back({e.down.mxfp4.codes, e.down.mxfp4.scales, e.down.bias});
      for (const void* p : {e.gate_up.mxfp4.codes, e.gate_up.mxfp4.scales, e.down.mxfp4.codes, e.down.mxfp4.scales})
        tables->aligned = tables->aligned && reinterpret_cast<uintptr_t>(p) % 16 == 0;
    }
    if (gate_up.empty() || w.top_k > cuda::kMoeDecodeMaxTopK || w.router.n > cuda::kMoeMaxExperts || H % 16 != 0)
      return nullptr;
    auto upload_table = [&](const std::vector<cuda::Mxfp4Device>& t, Buffer& dst) {
      dst = Buffer(*this, t.size() * sizeof(cuda::Mxfp4Device));
      copy_to_backend(dst.data(), t.data(), t.size() * sizeof(cuda::Mxfp4Device));
    };
    upload_table(gate_up, tables->gate_up);
    upload_table(down, tables->down);
    // One device pass over the scales (a byte each) and one flag back, at first use.
    Buffer outside(*this, 4);
    CUDA_CHECK(cudaMemsetAsync(outside.data(), 0, 4, cudaStreamPerThread));
    for (const MlpWeights& e : w.experts) {
      cuda::mxfp4_scales_outside_fold(e.gate_up.mxfp4.scales, e.gate_up.n * cuda::mxfp4_scale_stride(H),
                                      outside.data<unsigned>());
      cuda::mxfp4_scales_outside_fold(e.down.mxfp4.scales, H * cuda::mxfp4_scale_stride(tables->inter),
                                      outside.data<unsigned>());
    }
    CUDA_CHECK_LAUNCH("mxfp4_scales_outside_fold");
    unsigned flag = 1;
    copy_to_host(&flag, outside.data(), 4);
    tables->fold_scales = flag == 0;
    tables->usable = true;
    return tables.get();
  }
  // Router (with its bias), softmax top-k on the device, then the two expert launches.
  // router_io (a dense router in a GEMV layout): the router reads the rows raw and normalises them
  // itself, writing the normalised rows to x (router_io->normed_out) for the experts.
  void run_moe_mxfp4(const MoeWeights& w, const Mxfp4Tables& tables, const float* x, int64_t m, float* out,
                     bool accumulate, const cuda::GemvIo* router_io = nullptr, const float* raw = nullptr) {
    const int64_t H = w.router.k, E = w.router.n, K = w.top_k;
    Buffer logits(*this, size_t(m * E) * 4), ids(*this, size_t(m * K) * 4), weights(*this, size_t(m * K) * 4);
    Buffer act(*this, size_t(m * K * tables.inter) * 2);  // f16, staged for the down projection
    if (router_io)
      gemv(w.router, raw, m, logits.data(), *router_io);
    else
      linear(w.router, x, m, logits.data(), true);
    // A routing launch writes ids and weights, which the down kernel reads before its wait (two
    // launches back) to start its first expert tiles. The streamed kernels can also route for
    // themselves from the logits (NIBBLE_MXFP4_KERNELS_ROUTE=1, for A/B runs): one launch less,
    // but the down kernel then took 15.7 µs a call instead of 10.6 and gpt-oss decoded 4-7%
    // slower (H100, BENCHMARKS.md). Qwen3's INT4 kernels are the other way round (run_moe_decode).
    static const bool kernels_route = std::getenv("NIBBLE_MXFP4_KERNELS_ROUTE") != nullptr;
    cuda::MoeRouting routing;
    if (kernels_route && cuda::moe_mxfp4_streamed(tables.aligned, m, tables.inter, H)) {
      routing.logits = logits.data(), routing.normalize = w.normalize;
    } else {
      moe_route(logits.data(), m, E, K, w.normalize, ids.data<int32_t>(), weights.data());
      routing.ids = ids.data<int32_t>(), routing.weights = weights.data();
    }
    routing.claim = moe_claims();
    cuda::moe_decode_mxfp4(tables.gate_up.data<cuda::Mxfp4Device>(), tables.down.data<cuda::Mxfp4Device>(), E,
                           routing, x, act.data(), out, accumulate, m, K, tables.inter, H, w.swiglu_alpha,
                           w.swiglu_limit, tables.aligned);
    CUDA_CHECK_LAUNCH("moe_decode_mxfp4");
  }

  // Device arrays of the experts' matrices for the fused decode kernels, built on first use and
  // kept in the weights' backend_state; `usable` is false when the experts are not all
  // interleaved INT4 of one shape.
  struct ExpertTables {
    bool usable = false;
    int64_t group_shift = 0;
    Buffer gate, up, down;
    // The folded router's sums (cuda::RouterAcc), made on first use.
    Buffer fold_sums;
    int fold_replicas = 0;
    int64_t fold_stride = 0;
  };
  // Copies of the folded router's sums (every o block adds to each; expert block b reads copy b
  // mod n): one measured best (kernels/moe_route.cuh). NIBBLE_ROUTER_FOLD_REPLICAS=n (1..16, down
  // to a power of two, as the readers' mask needs) for A/B runs.
  static int router_fold_replicas() {
    static const int n = [] {
      const char* env = std::getenv("NIBBLE_ROUTER_FOLD_REPLICAS");
      const int want = env ? std::clamp(std::atoi(env), 1, 16) : 1;
      int pow2 = 1;
      while (2 * pow2 <= want) pow2 *= 2;
      return pow2;
    }();
    return n;
  }
  // The sums of w's folded router, zeroed once here (then after each use: router_clear_);
  // null while capturing a graph before they exist (their first zeroing is not to be recorded).
  const ExpertTables* router_fold_sums(const MoeWeights& w) {
    auto* tables = const_cast<ExpertTables*>(expert_tables(w));
    if (!tables) return nullptr;
    if (!tables->fold_sums.data()) {
      if (capturing_) {
        capture_failed_ = true;
        return nullptr;
      }
      const int replicas = router_fold_replicas();
      const int64_t stride = (w.router.n + 1 + 15) / 16 * 16;  // 128-byte lines a copy
      Buffer sums(*this, size_t(replicas * stride) * 8);
      CUDA_CHECK(cudaMemsetAsync(sums.data(), 0, sums.bytes(), cudaStreamPerThread));
      tables->fold_sums = std::move(sums);
      tables->fold_replicas = replicas, tables->fold_stride = stride;
    }
    return tables;
  }
  const ExpertTables* expert_tables(const MoeWeights& w) {
    if (!plain_moe(w)) return nullptr;  // backend_state may hold Mxfp4Tables
    if (w.backend_state) {
      const auto* tables = static_cast<const ExpertTables*>(w.backend_state.get());
      return tables->usable ? tables : nullptr;
    }
    if (capturing_) {  // building them copies from the host: not while recording
      capture_failed_ = true;
      return nullptr;
    }
    auto tables = std::make_shared<ExpertTables>();
    w.backend_state = tables;
    std::vector<cuda::Int4Device> gate, up, down;
    for (const MlpWeights& e : w.experts) {
      for (const LinearWeight* l : {&e.gate, &e.up, &e.down})
        if (l->format != WeightFormat::kInt4 || l->int4.layout != Int4Layout::kWarpInterleaved ||
            l->n != (l == &e.down ? w.router.k : w.experts[0].gate.n) ||
            int4_device(*l).group_shift != int4_device(w.experts[0].gate).group_shift)
          return nullptr;
      gate.push_back(int4_device(e.gate));
      up.push_back(int4_device(e.up));
      down.push_back(int4_device(e.down));
    }
    tables->usable = true;
    tables->group_shift = int4_device(w.experts[0].gate).group_shift;
    auto to_device = [&](const std::vector<cuda::Int4Device>& v) {
      Buffer b(*this, v.size() * sizeof(cuda::Int4Device));
      copy_to_backend(b.data(), v.data(), v.size() * sizeof(cuda::Int4Device));
      return b;
    };
    tables->gate = to_device(gate);
    tables->up = to_device(up);
    tables->down = to_device(down);
    return tables.get();
  }

  // Copies host memory into a new device buffer owned by `w`.
  const void* copy(const void* src, size_t bytes, LinearWeight& w) {
    auto buf = std::make_shared<Buffer>(*this, bytes);
    copy_to_backend(buf->data(), src, bytes);
    w.storage.push_back(buf);
    return buf->data();
  }

  void ensure_host_slots() {
    if (host_mailbox_) return;
    CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_mailbox_), kMailboxSlots * kMailboxInts * 4, 0));
    CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&staging_), kStagingSlots * kStagingBytes, 0));
    for (cudaEvent_t& e : mailbox_events_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    for (cudaEvent_t& e : staging_events_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  static constexpr int kStagingSlots = 8;
  static constexpr size_t kStagingBytes = 4096;
  int32_t* host_mailbox_ = nullptr;
  uint8_t* staging_ = nullptr;
  int staging_next_ = 0;
  cudaEvent_t mailbox_events_[kMailboxSlots] = {}, staging_events_[kStagingSlots] = {};
  OpProfiler profiler_;
  bool capturing_ = false, capture_failed_ = false;
  std::unordered_map<uint64_t, cudaGraphExec_t> graphs_;
  std::unordered_map<size_t, std::vector<void*>> free_blocks_;
  std::unordered_map<void*, size_t> block_size_;
  std::string timeline_path_;  // NIBBLE_TIMELINE: where the in-kernel timeline goes at exit
  Buffer route_counter_;  // the fused router's "last block routes" counter, 0 between launches
  Buffer attention_counters_;  // decode attention's split arrival counts (kernels/attention.cuh)
  Buffer argmax_counters_;     // the one-launch argmax's counters a row, 0 between launches
  unsigned* argmax_counters() { return argmax_counters_.data<unsigned>(); }
  // The streamed MXFP4 kernels' claim counters, 0 between launches: [0, 2) MoE gate/up's
  // (cuda::MoeRouting::claim), [2, 4) the GEMVs' (cuda::GemvIo::claim; the lm_head's). Separate
  // pairs: a layer's gate/up may still be running when a GEMV's claims begin, and the reverse.
  Buffer mxfp4_claims_;
  unsigned* moe_claims() { return mxfp4_claims_.data<unsigned>(); }
  unsigned* gemv_claims() { return mxfp4_claims_.data<unsigned>() + 2; }

  // Decode posts (post_ints): the device's count of the picks it posted, the mapped ring, and the
  // host's count of the posts it queued (direct launches, and each replay of a graph by the posts
  // recorded in it), which the device's count matches in stream order.
  // Where a launch that advances a one-row step posts its pick; count_post once it is queued.
  cuda::DecodePostArgs decode_post(int64_t rows) const {
    if (rows != 1) return {};
    return {post_seq_.data<unsigned>(), post_ring_device_};
  }
  void count_post(const int32_t* picked) {
    last_post_src_ = picked;
    ++(capturing_ ? capture_posts_ : posts_queued_);
  }
  Buffer post_seq_;
  unsigned long long* post_ring_ = nullptr;         // host view, kDecodePostRing entries
  unsigned long long* post_ring_device_ = nullptr;  // the device's view of the same memory
  const int32_t* last_post_src_ = nullptr;
  int64_t posts_queued_ = 0, capture_posts_ = 0;
  int64_t slot_post_[kMailboxSlots];  // the post a mailbox slot waits for, -1: its copy
  std::unordered_map<uint64_t, int64_t> graph_posts_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(); }

}  // namespace nibble
