// The CPU reference backend: plain loops in f32, parallel over output rows with OpenMP. It defines
// what every op computes; other backends are tested against it, and it is itself tested against
// Hugging Face transformers through the model fixtures.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <vector>

#include "backend/backend.h"
#include "core/fp8.h"
#include "core/status.h"

namespace nibble {
namespace {

// Below this many multiply-adds a parallel region costs more than it saves (thread wake-up and
// barriers), and on a loaded machine far more.
constexpr int64_t kMinParallelWork = 1 << 18;

float dot(const float* a, const float* b, int64_t n) {
  // Eight partial sums vectorise and keep rounding error well below the 1e-3 tolerance we hold
  // ourselves to against transformers.
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  return s + ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  std::string description() const override {
    return "CPU reference backend, " + std::to_string(omp_get_max_threads()) + " threads";
  }
  double copy_bandwidth() override {
    const size_t bytes = size_t(256) << 20;
    std::vector<uint8_t> a(bytes, 1), b(bytes);
    std::memcpy(b.data(), a.data(), bytes);  // warm-up: fault the pages in
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 4; ++i) std::memcpy(i % 2 ? a.data() : b.data(), i % 2 ? b.data() : a.data(), bytes);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return 4.0 * 2 * double(bytes) / s;
  }

  void* alloc(size_t bytes) override {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    NIBBLE_CHECK(p != nullptr, "out of memory allocating {} bytes", bytes);
    return p;
  }
  void free(void* ptr) override { std::free(ptr); }
  void copy_to_backend(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  LinearWeight upload(const LinearWeight& host) override { return host; }
  WeightVector upload(const WeightVector& host) override { return host; }
  LinearWeight prepare(const LinearWeight& w) override { return w; }

  void fill_random(void* dst, DType dtype, int64_t count, float lo, float hi, uint64_t seed) override {
    NIBBLE_CHECK(dtype == DType::U8 || dtype == DType::BF16 || dtype == DType::F16 || dtype == DType::F32,
                 "fill_random: {} is not supported", dtype_name(dtype));
#pragma omp parallel for schedule(static) if (count >= (1 << 20))
    for (int64_t i = 0; i < count; ++i) {
      const float u = hash_uniform(seed, uint64_t(i));
      switch (dtype) {
        case DType::U8:
          static_cast<uint8_t*>(dst)[i] = uint8_t(std::min(hi, lo + std::floor(u * (hi - lo + 1))));
          break;
        case DType::BF16: static_cast<uint16_t*>(dst)[i] = f32_to_bf16(lo + u * (hi - lo)); break;
        case DType::F16: static_cast<uint16_t*>(dst)[i] = f32_to_f16(lo + u * (hi - lo)); break;
        default: static_cast<float*>(dst)[i] = lo + u * (hi - lo); break;
      }
    }
  }

  void linear(const LinearWeight& w, const float* x, int64_t m, float* out) override {
    const int64_t n = w.n, k = w.k;
#pragma omp parallel if (n * k * m >= kMinParallelWork)
    {
      std::vector<float> row(static_cast<size_t>(k));
#pragma omp for schedule(static)
      for (int64_t r = 0; r < n; ++r) {
        w.row_f32(r, row.data());
        const float b = w.bias ? w.bias[r] : 0.f;
        for (int64_t t = 0; t < m; ++t) out[t * n + r] = dot(x + t * k, row.data(), k) + b;
      }
    }
  }

  void embed(const LinearWeight& table, const int32_t* ids, int64_t m, float* out) override {
    for (int64_t t = 0; t < m; ++t) table.row_f32(ids[t], out + t * table.k);
  }

  void rms_norm(const float* x, const WeightVector& weight, int64_t rows, int64_t dim, float eps,
                float* out) override {
    const float* w = weight.data;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * dim;
      float* yr = out + r * dim;
      const float inv = 1.f / std::sqrt(dot(xr, xr, dim) / float(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv * (w ? w[i] : 1.f);
    }
  }

  void qk_norm_rope_kv_write(const float* q_in, float* q_out, int64_t q_stride, const float* k_new,
                             const float* v_new, int64_t kv_stride, const WeightVector& q_norm,
                             const WeightVector& k_norm, float eps, const RopeTable& rope_table,
                             const int32_t* positions, int64_t m, int64_t n_head, int64_t n_head_kv,
                             int64_t head_dim, const KvPages& kv) override {
    const int64_t q_row = n_head * head_dim, row = n_head_kv * head_dim;
    std::vector<float> k(static_cast<size_t>(row));
    for (int64_t t = 0; t < m; ++t) {
      float* q = q_out + t * q_row;
      if (q_norm.data)
        rms_norm(q_in + t * q_stride, q_norm, n_head, head_dim, eps, q);
      else if (q != q_in + t * q_stride)
        std::copy_n(q_in + t * q_stride, q_row, q);
      rope(q, 1, n_head, head_dim, positions + t, rope_table);
      if (k_norm.data)
        rms_norm(k_new + t * kv_stride, k_norm, n_head_kv, head_dim, eps, k.data());
      else
        std::copy_n(k_new + t * kv_stride, row, k.data());
      rope(k.data(), 1, n_head_kv, head_dim, positions + t, rope_table);
      const int64_t r =
          kv_pool_row(kv_token_table(kv.block_table, kv.seq_rows, kv.table_stride, t), kv.block_size_log2, positions[t]);
      store_kv_row(kv.k, kv.dtype, r, k.data(), row);
      store_kv_row(kv.v, kv.dtype, r, v_new + t * kv_stride, row);
    }
  }

  // Row r of a KV pool ([rows, n] of dtype F32, F16 or F8_E4M3) from / to f32.
  static void store_kv_row(void* pool, DType dtype, int64_t r, const float* x, int64_t n) {
    if (dtype == DType::F32) {
      std::copy_n(x, n, static_cast<float*>(pool) + r * n);
    } else if (dtype == DType::F8_E4M3) {
      uint8_t* dst = static_cast<uint8_t*>(pool) + r * n;
      for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_e4m3(x[i]);
    } else {
      uint16_t* dst = static_cast<uint16_t*>(pool) + r * n;
      for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_f16(x[i]);
    }
  }
  // Elements [offset, offset + n) of row r; f32 pools are returned in place, others via `scratch`.
  static const float* load_kv(const void* pool, DType dtype, int64_t r, int64_t row, int64_t offset, int64_t n,
                              float* scratch) {
    if (dtype == DType::F32) return static_cast<const float*>(pool) + r * row + offset;
    if (dtype == DType::F8_E4M3) {
      const uint8_t* src = static_cast<const uint8_t*>(pool) + r * row + offset;
      for (int64_t i = 0; i < n; ++i) scratch[i] = e4m3_to_f32(src[i]);
      return scratch;
    }
    const uint16_t* src = static_cast<const uint16_t*>(pool) + r * row + offset;
    for (int64_t i = 0; i < n; ++i) scratch[i] = f16_to_f32(src[i]);
    return scratch;
  }

  void rope(float* x, int64_t m, int64_t n_head, int64_t head_dim, const int32_t* positions,
            const RopeTable& table) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        // Angles in f32 as transformers computes them (inv_freq · position in float32).
        const float angle = float(positions[t]) * table.inv_freq.data[i];
        const float c = std::cos(angle) * table.attention_factor;
        const float s = std::sin(angle) * table.attention_factor;
        for (int64_t h = 0; h < n_head; ++h) {
          float* v = x + (t * n_head + h) * head_dim;
          const float a = v[i], b = v[i + half];
          v[i] = a * c - b * s;
          v[i + half] = b * c + a * s;
        }
      }
    }
  }

  void attention(const float* q, const KvPages& kv, int64_t m, const int32_t* positions, int64_t max_context,
                 int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale, float* out, const float* sinks,
                 int64_t window) override {
    const int64_t group = n_head / n_head_kv, row = n_head_kv * head_dim;
#pragma omp parallel if (m * n_head * max_context * head_dim >= kMinParallelWork)
    {
      std::vector<float> scores(static_cast<size_t>(max_context)), scratch(static_cast<size_t>(head_dim));
#pragma omp for collapse(2) schedule(static)
      for (int64_t t = 0; t < m; ++t) {
        for (int64_t h = 0; h < n_head; ++h) {
          const int64_t kvh = h / group, n_ctx = int64_t(positions[t]) + 1;
          const int64_t first = window > 0 ? std::max<int64_t>(0, n_ctx - window) : 0;
          NIBBLE_ASSERT(n_ctx <= max_context);
          const float* qh = q + (t * n_head + h) * head_dim;
          const int32_t* table = kv_token_table(kv.block_table, kv.seq_rows, kv.table_stride, t);
          auto pool_row = [&](int64_t j) { return kv_pool_row(table, kv.block_size_log2, j); };
          // The sink is one more logit in the softmax (transformers concatenates it as a last
          // column, subtracts the row's max and drops the column after the softmax).
          float max_score = sinks ? sinks[h] : -INFINITY;
          for (int64_t j = first; j < n_ctx; ++j) {
            const float* kj = load_kv(kv.k, kv.dtype, pool_row(j), row, kvh * head_dim, head_dim, scratch.data());
            scores[size_t(j)] = dot(qh, kj, head_dim) * scale;
            max_score = std::max(max_score, scores[size_t(j)]);
          }
          float sum = sinks ? std::exp(sinks[h] - max_score) : 0.f;
          for (int64_t j = first; j < n_ctx; ++j) sum += scores[size_t(j)] = std::exp(scores[size_t(j)] - max_score);
          float* oh = out + (t * n_head + h) * head_dim;
          std::fill(oh, oh + head_dim, 0.f);
          for (int64_t j = first; j < n_ctx; ++j) {
            const float p = scores[size_t(j)] / sum;
            const float* vj = load_kv(kv.v, kv.dtype, pool_row(j), row, kvh * head_dim, head_dim, scratch.data());
            for (int64_t d = 0; d < head_dim; ++d) oh[d] += p * vj[d];
          }
        }
      }
    }
  }

  void silu_mul(const float* gate, const float* up, int64_t count, float* out) override {
    for (int64_t i = 0; i < count; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  }

  void moe_route(const float* logits, int64_t m, int64_t n_experts, int64_t top_k, bool normalize,
                 int32_t* ids, float* weights) override {
    std::vector<float> probs(static_cast<size_t>(n_experts));
    std::vector<int32_t> order(static_cast<size_t>(n_experts));
    for (int64_t t = 0; t < m; ++t) {
      const float* l = logits + t * n_experts;
      const float mx = *std::max_element(l, l + n_experts);
      float sum = 0.f;
      for (int64_t e = 0; e < n_experts; ++e) sum += probs[size_t(e)] = std::exp(l[e] - mx);
      for (auto& p : probs) p /= sum;
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int32_t a, int32_t b) {
        return probs[size_t(a)] > probs[size_t(b)] || (probs[size_t(a)] == probs[size_t(b)] && a < b);
      });
      float top_sum = 0.f;
      for (int64_t j = 0; j < top_k; ++j) top_sum += probs[size_t(order[size_t(j)])];
      for (int64_t j = 0; j < top_k; ++j) {
        ids[t * top_k + j] = order[size_t(j)];
        weights[t * top_k + j] = probs[size_t(order[size_t(j)])] / (normalize ? top_sum : 1.f);
      }
    }
  }

  // Tokens are grouped by expert so each expert runs once over all the rows routed to it.
  void moe(const MoeWeights& w, const float* x, int64_t m, float* out) override {
    const int64_t H = w.router.k, E = w.router.n, K = w.top_k;
    std::vector<float> logits(static_cast<size_t>(m * E)), weights(static_cast<size_t>(m * K));
    std::vector<int32_t> ids(static_cast<size_t>(m * K));
    linear(w.router, x, m, logits.data());
    moe_route(logits.data(), m, E, K, w.normalize, ids.data(), weights.data());
    std::fill(out, out + m * H, 0.f);
    std::vector<float> rows, gate, up, both, result;
    std::vector<int64_t> slots;
    for (int64_t e = 0; e < E; ++e) {
      slots.clear();
      for (int64_t s = 0; s < m * K; ++s)
        if (ids[size_t(s)] == e) slots.push_back(s);
      if (slots.empty()) continue;
      const MlpWeights& ex = w.experts[size_t(e)];
      const int64_t n = int64_t(slots.size()), inter = ex.inter();
      rows.resize(size_t(n * H));
      gate.resize(size_t(n * inter));
      up.resize(size_t(n * inter));
      result.resize(size_t(n * H));
      for (int64_t r = 0; r < n; ++r) std::copy_n(x + slots[size_t(r)] / K * H, H, rows.data() + r * H);
      if (ex.gate_up.n) {  // rows alternate gate_j, up_j
        both.resize(size_t(n * 2 * inter));
        linear(ex.gate_up, rows.data(), n, both.data());
        for (int64_t i = 0; i < n * inter; ++i) {
          gate[size_t(i)] = both[size_t(2 * i)];
          up[size_t(i)] = both[size_t(2 * i + 1)];
        }
      } else {
        linear(ex.gate, rows.data(), n, gate.data());
        linear(ex.up, rows.data(), n, up.data());
      }
      for (int64_t i = 0; i < n * inter; ++i)
        gate[size_t(i)] = moe_activation(w.activation, gate[size_t(i)], up[size_t(i)], w.swiglu_alpha, w.swiglu_limit);
      linear(ex.down, gate.data(), n, result.data());
      for (int64_t r = 0; r < n; ++r) {
        const float wt = weights[size_t(slots[size_t(r)])];
        float* dst = out + slots[size_t(r)] / K * H;
        for (int64_t d = 0; d < H; ++d) dst[d] += wt * result[size_t(r * H + d)];
      }
    }
  }

  void add_rms_norm(const float* delta, float* x, const WeightVector& w, int64_t rows, int64_t dim,
                    float eps, float* out) override {
    add(delta, rows * dim, x);
    rms_norm(x, w, rows, dim, eps, out);
  }

  void add(const float* x, int64_t count, float* y) override {
    for (int64_t i = 0; i < count; ++i) y[i] += x[i];
  }
  void sample(const float* x, int64_t n, const SampleInputs* in, int32_t* out) override {
    std::vector<float> work;
    std::vector<int32_t> order;
    *out = sample_logits({x, size_t(n)}, *in, work, order);
  }

  void apply_penalties(float* logits, int64_t n, const PenaltyRow* rows, int64_t n_rows,
                       const PenaltyToken* tokens) override {
    for (int64_t r = 0; r < n_rows; ++r)
      nibble::apply_penalties({logits + rows[r].logits_row * n, size_t(n)}, rows[r].penalties,
                              {tokens + rows[r].first, size_t(rows[r].count)});
  }

  void argmax(const float* x, int64_t rows, int64_t n, int32_t* out) override {
    for (int64_t r = 0; r < rows; ++r) out[r] = int32_t(std::max_element(x + r * n, x + (r + 1) * n) - (x + r * n));
  }

  void advance_decode(const int32_t* picked, int64_t n, int32_t* ids, int32_t* positions) override {
    for (int64_t r = 0; r < n; ++r) ids[r] = picked[r], positions[r] += 1;
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }


}  // namespace nibble
