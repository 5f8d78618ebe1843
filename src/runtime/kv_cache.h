// Key/value cache of one sequence: per layer, K and V as [max_tokens, n_head_kv, head_dim] f32.
// Contiguous and single-sequence on purpose: it is what the CPU reference and `nibble run` need;
// the paged, prefix-shared block pool of the server replaces it there.
#pragma once

#include <cstdint>
#include <vector>

namespace nibble {

class KvCache {
 public:
  KvCache(int64_t n_layers, int64_t max_tokens, int64_t n_head_kv, int64_t head_dim)
      : max_tokens_(max_tokens), row_(n_head_kv * head_dim),
        k_(size_t(n_layers)), v_(size_t(n_layers)) {
    for (auto& t : k_) t.assign(size_t(max_tokens * row_), 0.f);
    for (auto& t : v_) t.assign(size_t(max_tokens * row_), 0.f);
  }
  int64_t max_tokens() const { return max_tokens_; }
  float* k(int64_t layer) { return k_[size_t(layer)].data(); }
  float* v(int64_t layer) { return v_[size_t(layer)].data(); }
  int64_t row_floats() const { return row_; }  // n_head_kv * head_dim

 private:
  int64_t max_tokens_, row_;
  std::vector<std::vector<float>> k_, v_;
};

}  // namespace nibble
