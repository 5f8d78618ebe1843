// The fixed list of operations a model's forward pass is built from, and the memory they run on.
// `cpu/` is the reference (simple, f32, OpenMP); every other backend is tested op by op against it
// (tests/ops). Activations are f32, row-major, in the backend's memory; shapes are passed
// explicitly ([m, dim] = m token rows). Weights are prepared once per backend by `upload`.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/kv_pages.h"
#include "backend/sampling.h"
#include "core/hash_random.h"
#include "model/weights.h"

namespace nibble {

// RoPE angles for one model: inv_freq[head_dim/2] and the YaRN attention factor on cos/sin.
struct RopeTable {
  WeightVector inv_freq;
  float attention_factor = 1.f;
};

// One kernel (or copy) the device ran, with device timestamps in ns (see Backend::start_trace).
struct KernelSpan {
  std::string name;  // the kernel's (mangled) symbol, or "memcpy ..."/"memset"
  uint64_t start_ns = 0, end_ns = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // The device, driver and runtime, for benchmark reports ("NVIDIA H100 80GB HBM3, driver ...").
  virtual std::string description() const = 0;
  // Measured device-to-device copy bandwidth in bytes/s (bytes read plus bytes written): the
  // roofline that benchmarks compare against.
  virtual double copy_bandwidth() = 0;

  // Memory of this backend (device memory for GPUs). alloc never returns null: it throws Error.
  virtual void* alloc(size_t bytes) = 0;
  virtual void free(void* ptr) = 0;
  virtual void copy_to_backend(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;
  // Copies that do not wait for the device (decode pipelining, Model::decode_enqueue): both run in
  // order with the work queued before them. copy_to_backend_queued returns as soon as `host_src`
  // may be reused; post_ints starts copying n <= kMailboxInts ints of this backend's memory to
  // host mailbox slot `slot` (< kMailboxSlots) and take_ints waits for that copy and returns the
  // values. The defaults copy at once (the CPU backend's memory is the host's).
  static constexpr int kMailboxSlots = 4;
  static constexpr int64_t kMailboxInts = 64;
  virtual void copy_to_backend_queued(void* dst, const void* host_src, size_t bytes) {
    copy_to_backend(dst, host_src, bytes);
  }
  virtual void post_ints(int slot, const int32_t* src, int64_t n);
  virtual void take_ints(int slot, int32_t* host_dst, int64_t n);
  // The device's free and total memory in bytes (for sizing a KV pool by a fraction of it);
  // false where the backend's memory is the host's.
  virtual bool memory_info(size_t* free_bytes, size_t* total_bytes) { return false; }
  // Weights as this backend computes with them (the CPU keeps the host views as they are).
  virtual LinearWeight upload(const LinearWeight& host) = 0;
  virtual WeightVector upload(const WeightVector& host) = 0;
  // The same for a weight already in this backend's memory in the CPU layout (dummy weights made
  // on the device): converted in place to the layout this backend computes with.
  virtual LinearWeight prepare(const LinearWeight& w) = 0;

  // Fills dst[count] (F32, F16, BF16 or U8) with values uniform in [lo, hi] (U8: integers lo..hi) from
  // a counter-based hash of (seed, index): every backend produces the same values.
  virtual void fill_random(void* dst, DType dtype, int64_t count, float lo, float hi, uint64_t seed) = 0;

  // out[m, n] = x[m, k] · Wᵀ (+ bias)
  virtual void linear(const LinearWeight& w, const float* x, int64_t m, float* out) = 0;
  // out[m, hidden] = rows `ids` of the table; ids in this backend's memory, already validated.
  virtual void embed(const LinearWeight& table, const int32_t* ids, int64_t m, float* out) = 0;
  // out[r] = x[r] / rms(x[r]) * w, over `rows` rows of `dim`; in place allowed
  virtual void rms_norm(const float* x, const WeightVector& w, int64_t rows, int64_t dim, float eps,
                        float* out) = 0;
  // The attention prologue, fused: per-head RMSNorm of the queries and of the new keys (skipped
  // where the norm weight is null), the half-split (NeoX) RoPE of both at positions[t], and the
  // write of keys and values (rounded to the cache's dtype) at sequence positions positions[t] of
  // the paged cache `kv`. Token t's queries are read at
  // q_in + t·q_stride ([n_head, hd]) and written to q_out [m, n_head, hd] (q_out may be q_in when
  // q_stride is n_head·hd); its new keys and values at k_new/v_new + t·kv_stride ([n_head_kv, hd]).
  // The strides let q, k and v come from one fused projection. positions are in this backend's
  // memory, so a recorded decode step replays at any position.
  virtual void qk_norm_rope_kv_write(const float* q_in, float* q_out, int64_t q_stride,
                                     const float* k_new, const float* v_new, int64_t kv_stride,
                                     const WeightVector& q_norm, const WeightVector& k_norm, float eps,
                                     const RopeTable& rope, const int32_t* positions, int64_t m,
                                     int64_t n_head, int64_t n_head_kv, int64_t head_dim,
                                     const KvPages& kv) = 0;
  // One weight whose rows are those of `parts` in order (q, k and v as one projection), in this
  // backend's layout; nullopt where the backend gains nothing from it or the parts differ in
  // format. The parts' own memory is released by the caller dropping them.
  virtual std::optional<LinearWeight> concat_rows(const std::vector<const LinearWeight*>& parts) {
    return std::nullopt;
  }
  // Causal attention of q[m, n_head, hd] over the paged cache `kv` (rows [n_head_kv, hd]): token t
  // attends to sequence positions 0..positions[t]; out[m, n_head, hd]. GQA: q head h reads kv head
  // h / (n_head / n_head_kv). max_context bounds every positions[t] + 1 (it sizes the work).
  // window > 0: only positions above positions[t] - window (a sliding-window layer). sinks (per q
  // head, this backend's memory, or null): a learned logit that joins each softmax's denominator
  // and carries no value (gpt-oss), so a head can attend to nothing.
  virtual void attention(const float* q, const KvPages& kv, int64_t m,
                         const int32_t* positions, int64_t max_context, int64_t n_head,
                         int64_t n_head_kv, int64_t head_dim, float scale, float* out,
                         const float* sinks = nullptr, int64_t window = 0) = 0;
  // out[i] = silu(gate[i]) * up[i]
  virtual void silu_mul(const float* gate, const float* up, int64_t count, float* out) = 0;
  // Routing: softmax over logits[m, n_experts], top-k (ties: lower expert id first), renormalised
  // to sum 1 when `normalize`. ids/weights are [m, top_k] in this backend's memory.
  virtual void moe_route(const float* logits, int64_t m, int64_t n_experts, int64_t top_k,
                         bool normalize, int32_t* ids, float* weights) = 0;
  // The whole MoE block: out[m, hidden] = Σ_top-k weight · down(act(gate(x), up(x))), with the
  // experts' biases where they have them and act = w.activation (weights.h).
  virtual void moe(const MoeWeights& w, const float* x, int64_t m, float* out) = 0;
  // y[i] += x[i]
  virtual void add(const float* x, int64_t count, float* y) = 0;
  // out[r] = index of the largest of x[r, 0..n) (the lowest index on ties): greedy sampling on
  // the device, so a decode step returns 4 bytes instead of a row of logits.
  virtual void argmax(const float* x, int64_t rows, int64_t n, int32_t* out) = 0;
  // Penalises rows of logits[*, n] in place: rows[0..n_rows) (this backend's memory, like
  // `tokens`) each name a logits row, its penalties and its slice of tokens; backend/sampling.h's
  // apply_penalties per row. Runs before argmax or sample: penalised requests stay on the device.
  virtual void apply_penalties(float* logits, int64_t n, const PenaltyRow* rows, int64_t n_rows,
                               const PenaltyToken* tokens) = 0;
  // out[0] = the token backend/sampling.h's sample_logits draws from x[0..n) with *in (both in
  // this backend's memory): temperature, min-p, top-k, top-p and the draw on the device, so a
  // sampled decode step also returns 4 bytes.
  virtual void sample(const float* x, int64_t n, const SampleInputs* in, int32_t* out) = 0;
  // The next decode step's inputs from this step's picks, in this backend's memory: ids[r] =
  // picked[r] and positions[r] += 1 for rows r < n. A recorded greedy or drawn decode step ends
  // with it, so the following step can run before the host has read the token.
  virtual void advance_decode(const int32_t* picked, int64_t n, int32_t* ids, int32_t* positions) = 0;
  // A greedy decode step's end: argmax(x, rows, n, out), then advance_decode(out, rows, ids,
  // positions). The CUDA backend does both in one launch.
  virtual void argmax_advance_decode(const float* x, int64_t rows, int64_t n, int32_t* out, int32_t* ids,
                                     int32_t* positions) {
    argmax(x, rows, n, out);
    advance_decode(out, rows, ids, positions);
  }
  // One token's logits (rms_norm_linear, m = 1) and its greedy pick with the next step's inputs
  // (argmax_advance_decode over them). The CUDA backend's streamed MXFP4 head picks as it goes.
  virtual void rms_norm_linear_pick(const float* x, const WeightVector& norm, float eps, const LinearWeight& w,
                                    float* logits, int32_t* out, int32_t* ids, int32_t* positions) {
    rms_norm_linear(x, norm, eps, w, 1, logits);
    argmax_advance_decode(logits, 1, w.n, out, ids, positions);
  }
  // The residual add fused with the next norm: x[r] += delta[r], then out[r] = rms_norm(x[r]) * w.
  virtual void add_rms_norm(const float* delta, float* x, const WeightVector& w, int64_t rows,
                            int64_t dim, float eps, float* out) = 0;

  // Fused forms of the residual stream x[m, hidden] around a projection or an MoE block, so a
  // decode step needs no separate norm or add kernels. Their meaning is the composition of the
  // ops above, and that composition is the default (and the reference the fused kernels are
  // tested against):
  //   rms_norm_linear: out[m, n] = linear(w, rms_norm(x) · norm)
  //   linear_add:      x[m, n] += linear(w, a)                   (the residual add)
  //   rms_norm_moe_add: x[m, h] += moe(w, rms_norm(x) · norm)
  virtual void rms_norm_linear(const float* x, const WeightVector& norm, float eps, const LinearWeight& w,
                               int64_t m, float* out);
  virtual void linear_add(const LinearWeight& w, const float* a, int64_t m, float* x);
  virtual void rms_norm_moe_add(const WeightVector& norm, float eps, const MoeWeights& w, int64_t m, float* x);
  //   linear_add_rms_norm_moe_add: linear_add(o, a, m, x), then rms_norm_moe_add(norm, eps, w, m, x)
  //                   (the CUDA backend folds the MoE router into the o projection at one token)
  virtual void linear_add_rms_norm_moe_add(const LinearWeight& o, const float* a, const WeightVector& norm, float eps,
                                           const MoeWeights& w, int64_t m, float* x);
  //   qk_norm_rope_attention: qk_norm_rope_kv_write (q to q_scratch [m, n_head, hd]), then attention
  //                   over the same cache, for a decode step: every token is its sequence's one new
  //                   token, so none attends to another's new row (the CUDA backend fuses both).
  virtual void qk_norm_rope_attention(const float* q_in, int64_t q_stride, const float* k_new, const float* v_new,
                                      int64_t kv_stride, const WeightVector& q_norm, const WeightVector& k_norm,
                                      float eps, const RopeTable& rope, const int32_t* positions, int64_t m,
                                      int64_t n_head, int64_t n_head_kv, int64_t head_dim, const KvPages& kv,
                                      int64_t max_context, float scale, float* q_scratch, float* out,
                                      const float* sinks = nullptr, int64_t window = 0);

  // Graphs: a decode step recorded once and replayed (CUDA graphs remove the launch overhead of
  // hundreds of small kernels). Between begin_capture and end_capture ops are recorded, not run;
  // end_capture returns whether a replayable graph was made (on false the caller runs the ops
  // again, uncaptured). replay runs the graph recorded under `key`, false if there is none. The
  // CPU backend records nothing.
  // A device-side trace of what runs between start_trace and stop_trace (for `bench --profile`):
  // false with the reason in *why_not when this backend or machine has none.
  virtual bool start_trace(std::string* why_not) {
    *why_not = "the " + name() + " backend has no kernel trace";
    return false;
  }
  virtual std::vector<KernelSpan> stop_trace() { return {}; }

  virtual bool supports_graphs() const { return false; }
  virtual bool replay(uint64_t key) { return false; }
  virtual void begin_capture(uint64_t key) {}
  virtual bool end_capture(uint64_t key) { return false; }
  // Frees the graph recorded under `key` (its KV cache is gone); the number still held.
  virtual void drop_graph(uint64_t key) {}
  virtual size_t graph_count() const { return 0; }

 protected:
  // Error unless slot < kMailboxSlots and n <= kMailboxInts (post_ints, take_ints).
  static void check_mailbox(const char* op, int slot, int64_t n);

 private:
  int32_t mailbox_[kMailboxSlots][kMailboxInts] = {};  // the default post_ints/take_ints
};

// Backend memory, freed on destruction.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Backend& backend, size_t bytes) : backend_(&backend), bytes_(bytes) {
    ptr_ = bytes ? backend.alloc(bytes) : nullptr;
  }
  Buffer(Buffer&& o) noexcept { swap(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    swap(o);
    return *this;
  }
  ~Buffer() {
    if (ptr_) backend_->free(ptr_);
  }
  template <typename T = float>
  T* data() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void swap(Buffer& o) {
    std::swap(backend_, o.backend_);
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
  }
  Backend* backend_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

std::unique_ptr<Backend> make_cpu_backend();
// "cpu" or "cuda" (Error when this build or machine lacks it).
std::unique_ptr<Backend> make_backend(const std::string& device);

}  // namespace nibble
