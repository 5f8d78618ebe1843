// Qwen3 and Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B; dense Qwen3 is the same graph with a
// SwiGLU MLP in every layer). Per layer:
//   h = x + o_proj(attn(rope(q_norm(q_proj(n1))), rope(k_norm(k_proj(n1))), v_proj(n1)))   n1 = rms(x)
//   x = h + mlp(rms(h))      mlp = MoE (softmax router, top-k, renormalised) or dense SwiGLU
// Shapes: [T, H] hidden rows, q [T, n_head, hd], k/v [T, n_head_kv, hd]; hd need not be H/n_head.
#include <algorithm>
#include <cmath>

#include "core/status.h"
#include "model/arch/registry.h"
#include "model/loader.h"

namespace nibble {
namespace {

class Qwen3Moe final : public Model {
 public:
  Qwen3Moe(const ModelConfig& config, const Checkpoint& ckpt, Backend& backend)
      : Model(config), backend_(backend), rope_(make_rope_table(config)) {
    const auto& c = config_;
    const int64_t hd = c.head_dim, H = c.hidden_size;
    WeightLoader load(ckpt, c);
    w_.embed = load.linear("model.embed_tokens", c.vocab_size, H);
    NIBBLE_CHECK(w_.embed.format != WeightFormat::kInt4, "{}: quantized embeddings are not "
                 "supported", ckpt.dir());
    w_.layers.resize(size_t(c.num_hidden_layers));
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i);
      LayerWeights& l = w_.layers[size_t(i)];
      l.input_norm = load.vector(p + ".input_layernorm.weight", H);
      l.post_attention_norm = load.vector(p + ".post_attention_layernorm.weight", H);
      l.q = load.linear(p + ".self_attn.q_proj", c.num_attention_heads * hd, H, c.attention_bias);
      l.k = load.linear(p + ".self_attn.k_proj", c.num_key_value_heads * hd, H, c.attention_bias);
      l.v = load.linear(p + ".self_attn.v_proj", c.num_key_value_heads * hd, H, c.attention_bias);
      l.o = load.linear(p + ".self_attn.o_proj", H, c.num_attention_heads * hd, c.attention_bias);
      l.q_norm = load.vector(p + ".self_attn.q_norm.weight", hd);
      l.k_norm = load.vector(p + ".self_attn.k_norm.weight", hd);
      l.is_moe = c.is_moe_layer(i);
      if (l.is_moe) {
        l.router = load.linear(p + ".mlp.gate", c.num_experts, H);
        l.experts = load.experts(p + ".mlp.experts", c.num_experts, c.moe_intermediate_size, H);
      } else {
        l.mlp.gate = load.linear(p + ".mlp.gate_proj", c.intermediate_size, H);
        l.mlp.up = load.linear(p + ".mlp.up_proj", c.intermediate_size, H);
        l.mlp.down = load.linear(p + ".mlp.down_proj", H, c.intermediate_size);
      }
    }
    w_.final_norm = load.vector("model.norm.weight", H);
    if (c.tie_word_embeddings && !ckpt.has("lm_head.weight") && !ckpt.has("lm_head.qweight"))
      w_.lm_head = w_.embed;
    else
      w_.lm_head = load.linear("lm_head", c.vocab_size, H);
    for (auto& name : load.unused())
      fmt::print(stderr, "nibble: warning: {}: tensor '{}' is not used by {}\n", ckpt.dir(), name,
                 c.model_type);
  }

  KvCache make_kv_cache(int64_t max_tokens) const override {
    return KvCache(config_.num_hidden_layers, max_tokens, config_.num_key_value_heads,
                   config_.head_dim);
  }

  void forward(std::span<const int32_t> tokens, int64_t pos0, KvCache& kv, bool all_logits,
               std::vector<float>& logits) override {
    const auto& c = config_;
    const int64_t T = int64_t(tokens.size()), H = c.hidden_size, hd = c.head_dim;
    const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads;
    NIBBLE_CHECK(T > 0, "forward: no tokens");
    NIBBLE_CHECK(pos0 + T <= kv.max_tokens(), "sequence of {} tokens does not fit the context of {} "
                 "tokens", pos0 + T, kv.max_tokens());
    std::vector<int64_t> pos(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = pos0 + t;

    std::vector<float> x(static_cast<size_t>(T * H)), normed(size_t(T * H)), attn(size_t(T * nh * hd));
    std::vector<float> q(static_cast<size_t>(T * nh * hd)), proj(size_t(T * H));
    backend_.embed(w_.embed, tokens.data(), T, x.data());
    trace("embed", x.data(), T, H);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const LayerWeights& l = w_.layers[size_t(i)];
      const std::string name = "layers." + std::to_string(i);
      backend_.rms_norm(x.data(), l.input_norm.data(), T, H, float(c.rms_norm_eps), normed.data());
      float* k_new = kv.k(i) + pos0 * nkv * hd;  // this step's keys/values go straight to the cache
      float* v_new = kv.v(i) + pos0 * nkv * hd;
      backend_.linear(l.q, normed.data(), T, q.data());
      backend_.linear(l.k, normed.data(), T, k_new);
      backend_.linear(l.v, normed.data(), T, v_new);
      backend_.rms_norm(q.data(), l.q_norm.data(), T * nh, hd, float(c.rms_norm_eps), q.data());
      backend_.rms_norm(k_new, l.k_norm.data(), T * nkv, hd, float(c.rms_norm_eps), k_new);
      backend_.rope(q.data(), T, nh, hd, pos.data(), rope_);
      backend_.rope(k_new, T, nkv, hd, pos.data(), rope_);
      trace(name + ".q", q.data(), T, nh * hd);
      trace(name + ".k", k_new, T, nkv * hd);
      backend_.attention(q.data(), kv.k(i), kv.v(i), T, pos0, nh, nkv, hd,
                         1.f / std::sqrt(float(hd)), attn.data());
      backend_.linear(l.o, attn.data(), T, proj.data());
      trace(name + ".attn_out", proj.data(), T, H);
      backend_.add(proj.data(), T * H, x.data());
      backend_.rms_norm(x.data(), l.post_attention_norm.data(), T, H, float(c.rms_norm_eps),
                        normed.data());
      if (l.is_moe)
        moe(l, normed.data(), T, proj.data());
      else
        mlp(l.mlp, normed.data(), T, proj.data());
      trace(name + ".mlp_out", proj.data(), T, H);
      backend_.add(proj.data(), T * H, x.data());
      trace(name + ".out", x.data(), T, H);
    }
    const int64_t first = all_logits ? 0 : T - 1, rows = T - first;
    backend_.rms_norm(x.data() + first * H, w_.final_norm.data(), rows, H, float(c.rms_norm_eps),
                      normed.data());
    logits.resize(size_t(rows * c.vocab_size));
    backend_.linear(w_.lm_head, normed.data(), rows, logits.data());
    trace("logits", logits.data(), rows, c.vocab_size);
  }

 private:
  void mlp(const MlpWeights& m, const float* x, int64_t T, float* out) {
    const int64_t inter = m.gate.n;
    std::vector<float> gate(static_cast<size_t>(T * inter)), up(size_t(T * inter));
    backend_.linear(m.gate, x, T, gate.data());
    backend_.linear(m.up, x, T, up.data());
    backend_.silu_mul(gate.data(), up.data(), T * inter, gate.data());
    backend_.linear(m.down, gate.data(), T, out);
  }

  // Tokens are grouped by expert so each expert runs once over all the rows routed to it.
  void moe(const LayerWeights& l, const float* x, int64_t T, float* out) {
    const auto& c = config_;
    const int64_t H = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
    std::vector<float> router_logits(static_cast<size_t>(T * E)), weights(size_t(T * K));
    std::vector<int32_t> ids(static_cast<size_t>(T * K));
    backend_.linear(l.router, x, T, router_logits.data());
    backend_.moe_route(router_logits.data(), T, E, K, c.norm_topk_prob, ids.data(), weights.data());
    std::fill(out, out + T * H, 0.f);
    std::vector<float> rows, result;
    std::vector<int64_t> slots;
    for (int64_t e = 0; e < E; ++e) {
      slots.clear();
      for (int64_t s = 0; s < T * K; ++s)
        if (ids[size_t(s)] == e) slots.push_back(s);
      if (slots.empty()) continue;
      const int64_t n = int64_t(slots.size());
      rows.resize(size_t(n * H));
      result.resize(size_t(n * H));
      for (int64_t r = 0; r < n; ++r)
        std::copy_n(x + slots[size_t(r)] / K * H, H, rows.data() + r * H);
      mlp(l.experts[size_t(e)], rows.data(), n, result.data());
      for (int64_t r = 0; r < n; ++r) {
        const float w = weights[size_t(slots[size_t(r)])];
        float* dst = out + slots[size_t(r)] / K * H;
        for (int64_t d = 0; d < H; ++d) dst[d] += w * result[size_t(r * H + d)];
      }
    }
  }

  Backend& backend_;
  RopeTable rope_;
  ModelWeights w_;
};

}  // namespace

std::unique_ptr<Model> create_qwen3_moe(const ModelConfig& config, const Checkpoint& ckpt,
                                        Backend& backend) {
  return std::make_unique<Qwen3Moe>(config, ckpt, backend);
}

}  // namespace nibble
