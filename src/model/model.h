// A loaded model: configuration, weights on a backend, and the forward pass of its architecture.
// Architectures live in model/arch/, one file each, registered in model/registry.cpp.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "format/hf_config.h"
#include "runtime/kv_cache.h"
#include "runtime/kv_pool.h"

namespace nibble {

// Called with every named intermediate of a forward pass ("layers.3.out", [rows, dim]) when
// set: the hook for dumping a model layer by layer and comparing it with the reference.
using Tracer = std::function<void(const std::string& name, const float* data, int64_t rows, int64_t dim)>;

// A sequence's prompt chunk within a batched step (Model::forward_batch): tokens
// first .. first+count-1 of the step, at positions pos0.., in table row `row`; logits_row >= 0:
// the row of the step's logits that gets its last token's logits.
struct StepSegment {
  int64_t first, count, pos0, row, logits_row;
};

// One forward step as an architecture computes it: everything in the backend's memory, so the
// same recorded step can be replayed for the next token. The KV memory is either one sequence's
// KvCache or a KvPool shared by several sequences (then seq_rows gives each token's table row,
// the first n_single tokens are each a decoding sequence's one token and the segments follow).
struct Step {
  const int32_t* ids;        // [n_tokens]
  const int32_t* positions;  // [n_tokens]: position of each token in its sequence
  int64_t n_tokens;
  int64_t max_context;  // bound on positions + 1 (of the single-token rows in a batch): sizes attention's work
  bool all_logits;      // one sequence: logits for every token, or the last only
  float* logits;        // [n_tokens or 1, vocab]; a batch: [n_single + segments with logits, vocab]
  KvCache* cache = nullptr;
  const KvPool* pool = nullptr;
  const int32_t* seq_rows = nullptr;  // [n_tokens], with pool
  int64_t n_single = 0;
  std::vector<StepSegment> segments = {};
  // A greedy decode step's pick and next inputs (Model::replay_decode): project_logits may pick
  // with the logits (Backend::rms_norm_linear_pick), and then sets picked.
  struct Pick {
    int32_t* out;
    int32_t* ids;
    int32_t* positions;
  };
  const Pick* pick = nullptr;
  mutable bool picked = false;

  KvPages kv_layer(int64_t i) const { return cache ? cache->layer(i) : pool->layer(i, seq_rows); }
};

// A sequence's penalties and its distinct tokens (Sampler::penalty_tokens), applied to its logits
// on the device before its token is picked, so a penalised request returns a token id too.
struct TokenPenalties {
  Penalties penalties;
  std::span<const PenaltyToken> tokens;
  bool active() const { return penalties.active(); }
};

// One sequence's part of a batched step: its next tokens at positions pos0.., its KV in row
// `row` of the pool's block table, and what the step returns for it (the token picked after its
// last token, or that token's logits, or nothing for a prompt chunk that is not the last).
struct BatchEntry {
  enum class Output { kNone, kLogits, kGreedy, kSample };
  std::span<const int32_t> tokens;
  int64_t pos0 = 0;
  int64_t row = 0;
  Output output = Output::kGreedy;
  SampleInputs sample;        // kSample
  TokenPenalties penalties;   // kGreedy, kSample
};
struct BatchOutput {
  std::vector<int32_t> tokens;  // per entry: the picked token (kGreedy, kSample), else -1
  std::vector<float> logits;    // [entries with kLogits, vocab] in entry order
};

class Model {
 public:
  virtual ~Model() = default;
  const ModelConfig& config() const { return config_; }

  // Runs `tokens` at positions pos0 .. pos0+n-1 of one sequence whose earlier positions are in
  // `kv`, and appends their keys and values to it. Writes logits for every token ([n, vocab]) when
  // `all_logits`, else for the last one only ([1, vocab]). Single-token steps are recorded as a
  // graph once per (cache, context bucket) and replayed, unless graphs are off.
  void forward(std::span<const int32_t> tokens, int64_t pos0, KvCache& kv, bool all_logits,
               std::vector<float>& logits);
  // The same step, sampled greedily on the device (argmax of the last token's logits, lowest id
  // on ties): only the token id comes back to the host.
  // Active penalties are applied to the logits first.
  int32_t forward_greedy(std::span<const int32_t> tokens, int64_t pos0, KvCache& kv,
                         const TokenPenalties& penalties = {});
  // The same step with the token drawn on the device (Backend::sample with `in`).
  int32_t forward_sample(std::span<const int32_t> tokens, int64_t pos0, KvCache& kv, const SampleInputs& in,
                         const TokenPenalties& penalties = {});
  // Pipelined decode of one sequence, its tokens picked on the device (greedy, or drawn with
  // `sample`; no penalties): a step's input may be the token the step before it picked, still on
  // the device, so the host queues step n + 1 before it takes step n's token and the device never
  // waits on the host's round trip (the ~30 µs between steps that forward_greedy leaves).
  // decode_enqueue queues the step at pos0 over `kv` for `token`, or, with token < 0, for the token
  // of the last step queued on this model, which decode_can_chain(kv, pos0) must allow (it ran
  // over `kv` at pos0 - 1, and there is room). decode_take returns the token of the oldest step
  // queued over `kv`, waiting for it. Up to kDecodeQueue steps per cache and
  // Backend::kMailboxSlots in all (decode_room); a step queued and not wanted (the sequence
  // stopped) is taken and dropped by the caller. Without graphs (the CPU backend,
  // --enforce-eager) each step runs when queued.
  static constexpr int kDecodeQueue = 2;
  void decode_enqueue(int32_t token, int64_t pos0, KvCache& kv, const SampleInputs* sample = nullptr);
  bool decode_room(const KvCache& kv) const;
  bool decode_can_chain(const KvCache& kv, int64_t pos0) const {
    return decode_room(kv) && chain_kv_ == kv.id() && chain_pos_ >= 0 && chain_pos_ + 1 == pos0;
  }
  int32_t decode_take(const KvCache& kv);
  // Several sequences in one step over a shared KvPool (a server's batch): every weight is read
  // once for all of them. Decode steps (one token per sequence) are recorded per (batch size
  // bucket, context bucket) and replayed, padded to the bucket with rows that write only to the
  // pool's reserved block. The pool's table must hold each row's blocks (KvPool::set_row).
  void forward_batch(std::span<const BatchEntry> entries, KvPool& pool, BatchOutput& out);
  // Frees the steps recorded over `pool` (before it goes away).
  void release_graphs(const KvPool& pool);
  void set_use_graphs(bool on) { use_graphs_ = on; }
  // Frees the steps recorded for `kv` (call before the cache goes away: a server makes a cache
  // per request, and their graphs would otherwise pile up on the device).
  void release_graphs(const KvCache& kv);
  // A cache for one sequence of up to max_tokens positions, of the model's KV dtype (F16 unless
  // set_kv_dtype chose F32 or F8_E4M3), in blocks of 2^block_size_log2 positions.
  // Sliding-window layers keep a ring of window + ring_chunk positions where that is shorter than
  // max_tokens (KvCache); forward() then takes ring_chunk tokens at a time.
  virtual KvCache make_kv_cache(int64_t max_tokens, int block_size_log2 = KvCache::kDefaultBlockSizeLog2,
                                int64_t ring_chunk = KvCache::kDefaultRingChunk) const {
    std::vector<int64_t> windows;
    for (int64_t i = 0; i < config_.num_hidden_layers; ++i) windows.push_back(config_.layer_window(i));
    return KvCache(backend_, config_.num_hidden_layers, max_tokens, config_.num_key_value_heads, config_.head_dim,
                   kv_dtype_, block_size_log2, std::move(windows), ring_chunk);
  }
  // A pool shared by up to n_rows sequences of up to blocks_per_row blocks each (a server's).
  // n_sliding_blocks > 0: the sliding-window layers keep their K/V in a pool of their own of that
  // many blocks (KvPool), which holds only what the windows reach.
  std::unique_ptr<KvPool> make_kv_pool(int64_t n_blocks, int block_size_log2, int64_t n_rows,
                                       int64_t blocks_per_row, int64_t n_sliding_blocks = 0) const {
    std::vector<bool> sliding;
    for (int64_t i = 0; n_sliding_blocks > 0 && i < config_.num_hidden_layers; ++i)
      sliding.push_back(config_.layer_window(i) > 0);
    return std::make_unique<KvPool>(backend_, config_.num_hidden_layers, n_blocks, config_.num_key_value_heads,
                                    config_.head_dim, kv_dtype_, block_size_log2, n_rows, blocks_per_row,
                                    std::move(sliding), n_sliding_blocks);
  }
  int64_t n_sliding_layers() const {
    int64_t n = 0;
    for (int64_t i = 0; i < config_.num_hidden_layers; ++i) n += config_.layer_window(i) > 0;
    return n;
  }
  // Bytes of one block of every layer, or (sliding_apart) of the layers without a window only;
  // sliding_kv_bytes_per_block: of the windowed layers.
  int64_t kv_bytes_per_block(int block_size_log2, bool sliding_apart = false) const {
    return KvPool::bytes_per_block(config_.num_hidden_layers - (sliding_apart ? n_sliding_layers() : 0),
                                   config_.num_key_value_heads, config_.head_dim, kv_dtype_, block_size_log2);
  }
  int64_t sliding_kv_bytes_per_block(int block_size_log2) const {
    return KvPool::bytes_per_block(n_sliding_layers(), config_.num_key_value_heads, config_.head_dim, kv_dtype_,
                                   block_size_log2);
  }
  void set_kv_dtype(DType dtype) {
    NIBBLE_CHECK(kv_dtype_supported(dtype), "KV cache dtype {} is not supported (F16, F32 or F8_E4M3)", dtype_name(dtype));
    kv_dtype_ = dtype;
  }
  DType kv_dtype() const { return kv_dtype_; }
  // Bytes one decoded token reads: every weight it uses (the top-k experts of each MoE layer, one
  // embedding row) and, per token of context, the KV cache as this backend stores it.
  virtual int64_t weight_bytes_per_token() const = 0;
  int64_t kv_bytes_per_context_token() const {
    return 2 * config_.num_hidden_layers * config_.num_key_value_heads * config_.head_dim *
           int64_t(dtype_size_bytes(kv_dtype_));
  }

  void set_tracer(Tracer tracer) { tracer_ = std::move(tracer); }
  Backend& backend() const { return backend_; }

 protected:
  Model(ModelConfig config, Backend& backend) : config_(std::move(config)), backend_(backend) {
    static std::atomic<uint64_t> counter{0};
    id_ = ++counter;
  }
  virtual void compute(const Step& step) = 0;
  // Attention of a step's queries q [n_tokens, n_head, hd] into out: one call for one sequence;
  // for a batch one call for the single-token rows and one per prompt chunk.
  // Scratch of one step's attention blocks (allocated by the first layer, reused by the rest).
  struct AttentionBuffers {
    Buffer q, qkv, out;
  };
  // The attention block of layer `layer` on the residual stream x [T, hidden] (model/layers.cpp):
  // x += o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v)) over rms_norm(x) · input_norm,
  // with q, k and v fused into one projection where the backend did, q/k norms where l has
  // them, and l's sinks and sliding window. Appends the step's keys and values to its cache.
  // With `moe_norm` (a layer whose MoE block follows, when no tracer looks between them), the o
  // projection and the MoE block are one op: Backend::linear_add_rms_norm_moe_add(l.o, …,
  // *moe_norm, eps, l.moe), which a backend may fuse.
  void self_attention(const Step& step, int64_t layer, const LayerWeights& l, const RopeTable& rope, float* x,
                      AttentionBuffers& buffers, const WeightVector* moe_norm = nullptr) const;
  bool tracing() const { return static_cast<bool>(tracer_); }
  // sinks and window as Backend::attention takes them.
  void attend(const Step& step, int64_t layer, const float* q, int64_t n_head, int64_t n_head_kv, int64_t head_dim,
              float scale, float* out, const float* sinks = nullptr, int64_t window = 0) const;
  // The final norm and lm_head over the rows of x that the step wants logits of, into
  // step.logits; returns the number of rows written.
  int64_t project_logits(const Step& step, const float* x, const WeightVector& norm, float eps,
                         const LinearWeight& lm_head) const;
  // `data` is in the backend's memory; the tracer always gets a host copy.
  void trace(const std::string& name, const float* data, int64_t rows, int64_t dim) const {
    if (!tracer_) return;
    std::vector<float> host(static_cast<size_t>(rows * dim));
    backend_.copy_to_host(host.data(), data, host.size() * sizeof(float));
    tracer_(name, host.data(), rows, dim);
  }
  ModelConfig config_;
  Backend& backend_;
  Tracer tracer_;
  DType kv_dtype_ = DType::F16;

 private:
  // token_id set: the device picks the token (argmax, or the draw with `sample`), only its id
  // comes back; else the logits do.
  void run(std::span<const int32_t> tokens, int64_t pos0, KvCache& kv, bool all_logits, std::vector<float>* logits,
           const SampleInputs* sample, int32_t* token_id, const TokenPenalties* penalties = nullptr);
  // Backend::apply_penalties over logits[*, vocab]: rows[i].first is a row, .second its penalties.
  void penalize(float* logits, std::span<const std::pair<int64_t, const TokenPenalties*>> rows);
  Buffer penalty_rows_, penalty_tokens_;  // penalize's inputs, grown by doubling
  uint64_t id_;  // unique for the process's life: part of the graph keys
  bool use_graphs_ = true;
  // Fixed addresses for recorded steps.
  Buffer decode_ids_, decode_positions_, decode_logits_, decode_token_, decode_sample_;
  // A recorded single-sequence decode step over `kv` at `bucket` (its inputs already in decode_ids_
  // and decode_positions_), with the pick (argmax, or the draw with `sample`) and advance_decode
  // when `pick`.
  void replay_decode(KvCache& kv, int64_t bucket, bool pick, bool sample);
  void ensure_decode_buffers();
  // The decode step's token from decode_logits_ into decode_token_: the argmax, or the draw.
  void pick_decode(bool sample);
  // decode_enqueue's queue, oldest first: per step its cache, its mailbox slot (graphs) or its
  // token (eager); the last queued step's cache and position, which a chained step must follow.
  struct QueuedDecode {
    uint64_t kv;
    int slot;
    int32_t token;
  };
  std::vector<QueuedDecode> decode_queue_;
  uint64_t chain_kv_ = 0;
  int64_t chain_pos_ = -1;
  int32_t chain_token_ = -1;  // without graphs: the last queued step's token
  // NIBBLE_NO_DECODE_PIPELINE=1: decode_enqueue runs each step when queued (A/B runs).
  bool pipeline_decode_ = std::getenv("NIBBLE_NO_DECODE_PIPELINE") == nullptr;
  std::vector<uint64_t> capture_failures_;  // keys whose recording failed (tried at most twice)
  std::unordered_map<uint64_t, std::vector<uint64_t>> graph_keys_;  // KvCache id -> keys recorded for it
  std::unordered_map<uint64_t, std::vector<uint64_t>> pool_graph_keys_;  // KvPool id -> keys
  // Fixed addresses for recorded batch steps, sized for `batch_capacity_` rows.
  int64_t batch_capacity_ = 0;
  Buffer batch_ids_, batch_positions_, batch_rows_, batch_logits_, batch_tokens_;
  bool record_or_replay(uint64_t key, const std::function<void()>& ops, std::vector<uint64_t>& keys);
};

struct LoadOptions {
  bool enforce_eager = false;        // no graphs: every op launched as it comes
  std::string load_format = "auto";  // "auto": the checkpoint's safetensors; "dummy": random weights
  // With dummy weights: "" (BF16), "int4" (GPTQ-like, W4A16) or "mxfp4" (gpt-oss's experts as its
  // checkpoints store them).
  std::string quantization;
  int group_size = 128;
  // Linear roles quantized to INT4 at load (--quantize-layers: lm_head, qkv, o), in groups of
  // quantize_group_size.
  std::vector<std::string> quantize_layers;
  int quantize_group_size = 128;
  std::string quantize_format = "int4";  // --quantize-format: int4 or mxfp4
  DType kv_cache_dtype = DType::F16;  // F16, F32 or F8_E4M3 (--kv-cache-dtype)
};

// Parses --quantize-layers ("lm_head,qkv,o"; "" is none): Error naming an unknown or unsupported layer.
std::vector<std::string> parse_quantize_layers(const std::string& list);

// Reads config.json, picks the architecture by model_type and loads the weights. Errors name the
// file and the field or tensor that is wrong.
std::unique_ptr<Model> load_model(const std::string& model_dir, Backend& backend,
                                  const LoadOptions& options = {});

// --kv-cache-dtype: "auto" and "float16" (f16, the default), "float32" (exact); Error otherwise.
DType parse_kv_cache_dtype(const std::string& name);

// model_types nibble can run, for messages and `nibble info`.
std::vector<std::string> supported_model_types();

// Bytes one decoded token reads from `w`: every weight it uses (the top-k experts of each MoE
// layer, one embedding row); Model::weight_bytes_per_token of the architectures.
int64_t weight_bytes_per_token(const ModelWeights& w);

// inv_freq in host memory (upload it for other backends).
RopeTable make_rope_table(const ModelConfig& config);

}  // namespace nibble
