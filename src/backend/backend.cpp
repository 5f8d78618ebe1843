#include "backend/backend.h"

#include <algorithm>

#include "core/status.h"

namespace nibble {

void Backend::rms_norm_linear(const float* x, const WeightVector& norm, float eps, const LinearWeight& w,
                              int64_t m, float* out) {
  Buffer normed(*this, size_t(m * w.k) * sizeof(float));
  rms_norm(x, norm, m, w.k, eps, normed.data());
  linear(w, normed.data(), m, out);
}

void Backend::linear_add(const LinearWeight& w, const float* a, int64_t m, float* x) {
  Buffer y(*this, size_t(m * w.n) * sizeof(float));
  linear(w, a, m, y.data());
  add(y.data(), m * w.n, x);
}

void Backend::rms_norm_moe_add(const WeightVector& norm, float eps, const MoeWeights& w, int64_t m, float* x) {
  const int64_t hidden = w.router.k;
  Buffer normed(*this, size_t(m * hidden) * sizeof(float)), y(*this, size_t(m * hidden) * sizeof(float));
  rms_norm(x, norm, m, hidden, eps, normed.data());
  moe(w, normed.data(), m, y.data());
  add(y.data(), m * hidden, x);
}

void Backend::linear_add_rms_norm_moe_add(const LinearWeight& o, const float* a, const WeightVector& norm, float eps,
                                          const MoeWeights& w, int64_t m, float* x) {
  linear_add(o, a, m, x);
  rms_norm_moe_add(norm, eps, w, m, x);
}

void Backend::qk_norm_rope_attention(const float* q_in, int64_t q_stride, const float* k_new, const float* v_new,
                                     int64_t kv_stride, const WeightVector& q_norm, const WeightVector& k_norm,
                                     float eps, const RopeTable& rope, const int32_t* positions, int64_t m,
                                     int64_t n_head, int64_t n_head_kv, int64_t head_dim, const KvPages& kv,
                                     int64_t max_context, float scale, float* q_scratch, float* out,
                                     const float* sinks, int64_t window) {
  qk_norm_rope_kv_write(q_in, q_scratch, q_stride, k_new, v_new, kv_stride, q_norm, k_norm, eps, rope, positions, m,
                        n_head, n_head_kv, head_dim, kv);
  attention(q_scratch, kv, m, positions, max_context, n_head, n_head_kv, head_dim, scale, out, sinks, window);
}

void Backend::check_mailbox(const char* op, int slot, int64_t n) {
  NIBBLE_CHECK(slot >= 0 && slot < kMailboxSlots && n >= 0 && n <= kMailboxInts, "{}: slot {} of {}, {} ints of at "
               "most {}", op, slot, kMailboxSlots, n, kMailboxInts);
}

void Backend::post_ints(int slot, const int32_t* src, int64_t n) {
  check_mailbox("post_ints", slot, n);
  copy_to_host(mailbox_[slot], src, size_t(n) * 4);
}

void Backend::take_ints(int slot, int32_t* host_dst, int64_t n) {
  check_mailbox("take_ints", slot, n);
  std::copy(mailbox_[slot], mailbox_[slot] + n, host_dst);
}

#ifdef NIBBLE_HAVE_CUDA
std::unique_ptr<Backend> make_cuda_backend();
#endif

std::unique_ptr<Backend> make_backend(const std::string& device) {
  if (device == "cpu") return make_cpu_backend();
  if (device == "cuda") {
#ifdef NIBBLE_HAVE_CUDA
    return make_cuda_backend();
#else
    fail("--device cuda: this nibble was built without CUDA (configure with the cuda preset, "
         "NIBBLE_CUDA=ON)");
#endif
  }
  fail("--device {}: unknown device (cpu, cuda)", device);
}

}  // namespace nibble
