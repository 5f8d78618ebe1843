// The fixed list of operations a model's forward pass is built from. `cpu/` is the reference
// (simple, f32, OpenMP); every faster backend is tested op by op against it. Activations are f32,
// row-major, on the backend's device; shapes are passed explicitly ([m, dim] = m token rows).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/weights.h"

namespace nibble {

// RoPE angles for one model: inv_freq[head_dim/2] and the YaRN attention factor on cos/sin.
struct RopeTable {
  std::vector<float> inv_freq;
  float attention_factor = 1.f;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // out[m, n] = x[m, k] · Wᵀ (+ bias)
  virtual void linear(const LinearWeight& w, const float* x, int64_t m, float* out) = 0;
  // out[m, hidden] = rows `ids` of the table
  virtual void embed(const LinearWeight& table, const int32_t* ids, int64_t m, float* out) = 0;
  // out[r] = x[r] / rms(x[r]) * w, over `rows` rows of `dim`; in place allowed
  virtual void rms_norm(const float* x, const float* w, int64_t rows, int64_t dim, float eps,
                        float* out) = 0;
  // Rotates x[m, n_head, head_dim] in place by the half-split (NeoX) convention at positions pos[m].
  virtual void rope(float* x, int64_t m, int64_t n_head, int64_t head_dim, const int64_t* pos,
                    const RopeTable& table) = 0;
  // Causal attention of q[m, n_head, hd] (tokens at positions pos0..pos0+m-1) over the cache
  // k/v[0 .. pos0+m, n_head_kv, hd]; out[m, n_head, hd]. GQA: q head h reads kv head h / (n_head /
  // n_head_kv).
  virtual void attention(const float* q, const float* k_cache, const float* v_cache, int64_t m,
                         int64_t pos0, int64_t n_head, int64_t n_head_kv, int64_t head_dim,
                         float scale, float* out) = 0;
  // out[i] = silu(gate[i]) * up[i]
  virtual void silu_mul(const float* gate, const float* up, int64_t count, float* out) = 0;
  // Softmax over logits[m, n_experts], top-k (ties: lower expert id first), renormalised to sum 1
  // when `normalize`. ids/weights are [m, top_k].
  virtual void moe_route(const float* logits, int64_t m, int64_t n_experts, int64_t top_k,
                         bool normalize, int32_t* ids, float* weights) = 0;
  // y[i] += x[i]
  virtual void add(const float* x, int64_t count, float* y) = 0;
};

std::unique_ptr<Backend> make_cpu_backend();

}  // namespace nibble
