// The attention prologue (q/k RMSNorm, RoPE, the KV-cache write) as decode attention takes it when
// fused (kernels/attention.cuh): plain pointers and scalars, shared by the kernel and its host
// launcher (backend/cuda/launch.h), so neither copies the other's fields.
#pragma once

#include <cstdint>

namespace nibble::kernels {

// q, k and v raw from the projection; every token must be its sequence's one new token.
// q_in null: no prologue (q is ready).
struct AttentionPrologue {
  const float* q_in = nullptr;  // token t's heads at q_in + t * q_stride, [n_head, HD]
  int64_t q_stride = 0;
  const float* k_new = nullptr;  // token t's [n_head_kv, HD] at + t * kv_stride
  const float* v_new = nullptr;
  int64_t kv_stride = 0;
  const float* q_norm = nullptr;  // [HD] or null (no norm)
  const float* k_norm = nullptr;
  float eps = 0.f;
  const float* inv_freq = nullptr;  // [HD / 2]
  float attention_factor = 1.f;
};

}  // namespace nibble::kernels
