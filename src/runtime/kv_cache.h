// Key/value cache of one sequence: per layer, K and V as [max_tokens, n_head_kv, head_dim] f32 in
// the backend's memory. Contiguous and single-sequence on purpose: it is what the reference path
// and `nibble run` need; the paged, prefix-shared block pool of the server replaces it there.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace nibble {

class KvCache {
 public:
  KvCache(Backend& backend, int64_t n_layers, int64_t max_tokens, int64_t n_head_kv, int64_t head_dim)
      : id_(next_id()), max_tokens_(max_tokens), row_(n_head_kv * head_dim) {
    const size_t bytes = size_t(max_tokens * row_) * sizeof(float);
    for (int64_t i = 0; i < n_layers; ++i) {
      k_.emplace_back(backend, bytes);
      v_.emplace_back(backend, bytes);
    }
  }
  int64_t max_tokens() const { return max_tokens_; }
  float* k(int64_t layer) { return k_[size_t(layer)].data(); }
  float* v(int64_t layer) { return v_[size_t(layer)].data(); }
  int64_t row_floats() const { return row_; }  // n_head_kv * head_dim
  // Unique for the process's life (graphs recorded for one cache are never replayed on another
  // that happens to reuse its address).
  uint64_t id() const { return id_; }

 private:
  static uint64_t next_id() {
    static std::atomic<uint64_t> counter{0};
    return ++counter;
  }
  uint64_t id_;
  int64_t max_tokens_, row_;
  std::vector<Buffer> k_, v_;
};

}  // namespace nibble
