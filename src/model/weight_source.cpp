#include "model/weight_source.h"

#include <fmt/format.h>

#include <cmath>

#include "core/status.h"
#include "format/quant/int4_gptq.h"
#include "model/loader.h"

namespace nibble {

std::string linear_role(const std::string& prefix) {
  if (prefix == "lm_head") return "lm_head";
  if (prefix.ends_with(".mlp.gate") || prefix.ends_with(".mlp.router")) return "router";
  if (prefix.ends_with(".self_attn.q_proj") || prefix.ends_with(".self_attn.k_proj") ||
      prefix.ends_with(".self_attn.v_proj"))
    return "qkv";
  if (prefix.ends_with(".self_attn.o_proj")) return "o";
  return {};
}

namespace {

class CheckpointSource final : public WeightSource {
 public:
  CheckpointSource(std::shared_ptr<const Checkpoint> ckpt, const ModelConfig& config, Backend& backend)
      : ckpt_(std::move(ckpt)), loader_(*ckpt_, config), backend_(backend), config_(config) {}

  LinearWeight load_linear(const std::string& prefix, int64_t n, int64_t k, bool has_bias, int int4_group) override {
    LinearWeight host = loader_.linear(prefix, n, k, has_bias);
    if (int4_group > 0 && quantizes_to_mxfp4() && host.format != WeightFormat::kInt4) {
      NIBBLE_CHECK(k % kMxfp4Block == 0, "--quantize-layers: '{}' has {} inputs, not a multiple of {} (MXFP4 "
                   "blocks)", prefix, k, kMxfp4Block);
      LinearWeight q = mxfp4_weight(prefix, quantize_mxfp4(n, k, [&](int64_t row, float* out) {
                                      host.row_f32(row, out);
                                    }));
      q.bias = host.bias;
      q.storage.insert(q.storage.end(), host.storage.begin(), host.storage.end());
      host = std::move(q);
    } else if (int4_group > 0 && host.format != WeightFormat::kInt4) {
      NIBBLE_CHECK(k % 8 == 0, "--quantize-layers: '{}' has {} inputs, not a multiple of 8", prefix, k);
      LinearWeight q = int4_weight(prefix, quantize_int4(n, k, int4_group, false, [&](int64_t row, float* out) {
                                     host.row_f32(row, out);
                                   }));
      q.bias = host.bias;
      q.storage.insert(q.storage.end(), host.storage.begin(), host.storage.end());
      host = std::move(q);
    }
    return keep(backend_.upload(host));
  }
  WeightVector vector(const std::string& name, int64_t n) override {
    return backend_.upload(loader_.vector(name, n));
  }
  std::vector<MlpWeights> experts(const std::string& prefix, int64_t n_experts, int64_t inter,
                                  int64_t hidden) override {
    std::vector<MlpWeights> out;
    for (MlpWeights& e : loader_.experts(prefix, n_experts, inter, hidden))
      out.push_back({keep(backend_.upload(e.gate)), keep(backend_.upload(e.up)), keep(backend_.upload(e.down))});
    return out;
  }
  std::vector<MlpWeights> gpt_oss_experts(const std::string& prefix, int64_t n_experts, int64_t inter,
                                          int64_t hidden) override {
    std::vector<MlpWeights> out;
    for (MlpWeights& e : loader_.gpt_oss_experts(prefix, n_experts, inter, hidden)) {
      MlpWeights m;
      m.gate_up = keep(backend_.upload(e.gate_up));
      m.down = keep(backend_.upload(e.down));
      out.push_back(std::move(m));
    }
    return out;
  }
  bool has(const std::string& prefix) const override {
    return ckpt_->has(prefix + ".weight") || ckpt_->has(prefix + ".qweight");
  }
  void finish() override {
    for (auto& name : loader_.unused())
      fmt::print(stderr, "nibble: warning: {}: tensor '{}' is not used by {}\n", ckpt_->dir(), name,
                 config_.model_type);
  }

 private:
  // Views into the checkpoint's mapping keep the checkpoint open.
  LinearWeight keep(LinearWeight w) {
    w.storage.push_back(ckpt_);
    return w;
  }
  std::shared_ptr<const Checkpoint> ckpt_;
  WeightLoader loader_;
  Backend& backend_;
  const ModelConfig& config_;
};

class DummySource final : public WeightSource {
 public:
  DummySource(const ModelConfig& config, Backend& backend, const DummyOptions& options)
      : backend_(backend), o_(options), tied_(config.tie_word_embeddings) {}

  LinearWeight load_linear(const std::string& prefix, int64_t n, int64_t k, bool has_bias, int int4_group) override {
    LinearWeight w;
    w.name = prefix;
    w.n = n;
    w.k = k;
    if (int4_group > 0 && quantizes_to_mxfp4()) {  // --quantize-layers ... --quantize-format mxfp4
      w = random_mxfp4(prefix, n, k);
      if (has_bias) w.bias = static_cast<const float*>(fill(w, DType::F32, n, -0.1f, 0.1f));
      return w;
    }
    if ((o_.int4 && prefix.ends_with("_proj")) || int4_group > 0) {
      NIBBLE_CHECK(k % 8 == 0 && n % 8 == 0, "--quantization int4: '{}' is [{}, {}], not a multiple "
                   "of 8", prefix, n, k);
      w.format = WeightFormat::kInt4;
      const int group = int4_group > 0 ? int4_group : o_.group_size;
      w.int4.group_size = group > 0 ? group : k;
      w.int4.n_groups = (k + w.int4.group_size - 1) / w.int4.group_size;
      // Random codes, symmetric (zero point 8) and small positive scales: weights of magnitude
      // ~0.01 whose sums stay finite through 48 layers, as GPTQ/AutoRound sym checkpoints.
      w.int4.codes = static_cast<const uint8_t*>(fill(w, DType::U8, n * ((k + 1) / 2), 0, 255));
      w.int4.scales = static_cast<const uint16_t*>(fill(w, DType::F16, n * w.int4.n_groups, 0.001f, 0.003f));
      w.int4.zeros = nullptr;
      if (has_bias) w.bias = static_cast<const float*>(fill(w, DType::F32, n, -0.1f, 0.1f));
      return backend_.prepare(w);
    } else {
      w.format = WeightFormat::kBF16;
      const float bound = 1.f / std::sqrt(float(k));
      w.dense = fill(w, DType::BF16, n * k, -bound, bound);
    }
    if (has_bias) w.bias = static_cast<const float*>(fill(w, DType::F32, n, -0.1f, 0.1f));
    return w;
  }
  WeightVector vector(const std::string& name, int64_t n) override {
    auto buf = std::make_shared<Buffer>(backend_, size_t(n) * 4);
    backend_.fill_random(buf->data(), DType::F32, n, 0.9f, 1.1f, next_seed());
    return {buf->data(), n, buf};
  }
  std::vector<MlpWeights> experts(const std::string& prefix, int64_t n_experts, int64_t inter,
                                  int64_t hidden) override {
    std::vector<MlpWeights> out;
    for (int64_t e = 0; e < n_experts; ++e) {
      const std::string p = prefix + "." + std::to_string(e);
      out.push_back({load_linear(p + ".gate_proj", inter, hidden, false, 0),
                     load_linear(p + ".up_proj", inter, hidden, false, 0),
                     load_linear(p + ".down_proj", hidden, inter, false, 0)});
    }
    return out;
  }
  std::vector<MlpWeights> gpt_oss_experts(const std::string& prefix, int64_t n_experts, int64_t inter,
                                          int64_t hidden) override {
    std::vector<MlpWeights> out;
    for (int64_t e = 0; e < n_experts; ++e) {
      const std::string p = prefix + "." + std::to_string(e);
      MlpWeights m;
      m.gate_up = o_.mxfp4 ? random_mxfp4(p + ".gate_up_proj", 2 * inter, hidden)
                           : load_linear(p + ".gate_up_proj", 2 * inter, hidden, false, 0);
      m.down = o_.mxfp4 ? random_mxfp4(p + ".down_proj", hidden, inter) : load_linear(p + ".down_proj", hidden, inter,
                                                                                     false, 0);
      m.gate_up.bias = static_cast<const float*>(fill(m.gate_up, DType::F32, 2 * inter, -0.1f, 0.1f));
      m.down.bias = static_cast<const float*>(fill(m.down, DType::F32, hidden, -0.1f, 0.1f));
      out.push_back(std::move(m));
    }
    return out;
  }
  bool has(const std::string& prefix) const override { return !(prefix == "lm_head" && tied_); }

 private:
  const void* fill(LinearWeight& w, DType dtype, int64_t count, float lo, float hi) {
    auto buf = std::make_shared<Buffer>(backend_, size_t(count) * dtype_size_bytes(dtype));
    backend_.fill_random(buf->data(), dtype, count, lo, hi, next_seed());
    w.storage.push_back(buf);
    return buf->data();
  }
  // Random codes and scales 2^-9 .. 2^-7: weights of magnitude up to ~0.05, like gpt-oss's.
  LinearWeight random_mxfp4(const std::string& name, int64_t n, int64_t k) {
    NIBBLE_CHECK(k % kMxfp4Block == 0, "MXFP4 dummy weights: '{}' has {} inputs, not a multiple of {}", name, k,
                 kMxfp4Block);
    LinearWeight w;
    w.name = name;
    w.n = n;
    w.k = k;
    w.format = WeightFormat::kMxfp4;
    w.mxfp4.codes = static_cast<const uint8_t*>(fill(w, DType::U8, n * k / 2, 0, 255));
    w.mxfp4.scales = static_cast<const uint8_t*>(fill(w, DType::U8, n * k / kMxfp4Block, 118, 120));
    return backend_.prepare(w);
  }
  uint64_t next_seed() { return o_.seed * 0x9e3779b97f4a7c15ull + ++counter_; }
  Backend& backend_;
  DummyOptions o_;
  bool tied_;
  uint64_t counter_ = 0;
};

}  // namespace

std::unique_ptr<WeightSource> checkpoint_source(std::shared_ptr<const Checkpoint> ckpt,
                                                const ModelConfig& config, Backend& backend) {
  return std::make_unique<CheckpointSource>(std::move(ckpt), config, backend);
}

std::unique_ptr<WeightSource> dummy_source(const ModelConfig& config, Backend& backend,
                                           const DummyOptions& options) {
  return std::make_unique<DummySource>(config, backend, options);
}

}  // namespace nibble
