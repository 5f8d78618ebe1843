// Qwen3 and Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B; dense Qwen3 is the same graph with a
// SwiGLU MLP in every layer). Per layer:
//   h = x + o_proj(attn(rope(q_norm(q_proj(n1))), rope(k_norm(k_proj(n1))), v_proj(n1)))   n1 = rms(x)
//   x = h + mlp(rms(h))      mlp = MoE (softmax router, top-k, renormalised) or dense SwiGLU
// Shapes: [T, H] hidden rows, q [T, n_head, hd], k/v [T, n_head_kv, hd]; hd need not be H/n_head.
#include <cmath>

#include "core/status.h"
#include "model/arch/registry.h"

namespace nibble {
namespace {

class Qwen3Moe final : public Model {
 public:
  Qwen3Moe(const ModelConfig& config, WeightSource& src, Backend& backend) : Model(config, backend) {
    const auto& c = config_;
    const int64_t hd = c.head_dim, H = c.hidden_size;
    auto linear = [&](const std::string& name, int64_t n, int64_t k, bool bias = false) {
      return src.linear(name, n, k, bias);
    };
    auto vector = [&](const std::string& name, int64_t n) { return src.vector(name, n); };
    w_.embed = linear("model.embed_tokens", c.vocab_size, H);
    NIBBLE_CHECK(w_.embed.format != WeightFormat::kInt4, "{}: quantized embeddings are not "
                 "supported", c.path);
    w_.layers.resize(size_t(c.num_hidden_layers));
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i);
      LayerWeights& l = w_.layers[size_t(i)];
      l.input_norm = vector(p + ".input_layernorm.weight", H);
      l.post_attention_norm = vector(p + ".post_attention_layernorm.weight", H);
      l.q = linear(p + ".self_attn.q_proj", c.num_attention_heads * hd, H, c.attention_bias);
      l.k = linear(p + ".self_attn.k_proj", c.num_key_value_heads * hd, H, c.attention_bias);
      l.v = linear(p + ".self_attn.v_proj", c.num_key_value_heads * hd, H, c.attention_bias);
      l.o = linear(p + ".self_attn.o_proj", H, c.num_attention_heads * hd, c.attention_bias);
      if (auto qkv = backend_.concat_rows({&l.q, &l.k, &l.v})) {
        l.qkv = std::move(*qkv);
        l.q = l.k = l.v = LinearWeight{};
      }
      l.q_norm = vector(p + ".self_attn.q_norm.weight", hd);
      l.k_norm = vector(p + ".self_attn.k_norm.weight", hd);
      l.is_moe = c.is_moe_layer(i);
      if (l.is_moe) {
        l.moe.router = linear(p + ".mlp.gate", c.num_experts, H);
        l.moe.top_k = c.num_experts_per_tok;
        l.moe.normalize = c.norm_topk_prob;
        l.moe.experts = src.experts(p + ".mlp.experts", c.num_experts, c.moe_intermediate_size, H);
      } else {
        l.mlp.gate = linear(p + ".mlp.gate_proj", c.intermediate_size, H);
        l.mlp.up = linear(p + ".mlp.up_proj", c.intermediate_size, H);
        l.mlp.down = linear(p + ".mlp.down_proj", H, c.intermediate_size);
      }
    }
    w_.final_norm = vector("model.norm.weight", H);
    if (c.tie_word_embeddings && !src.has("lm_head"))  // the embedding table, or its 4-bit copy
      w_.lm_head = src.quantizes("lm_head") ? src.linear("model.embed_tokens", c.vocab_size, H, false, "lm_head")
                                            : w_.embed;
    else
      w_.lm_head = linear("lm_head", c.vocab_size, H);
    RopeTable rope = make_rope_table(c);
    rope_ = {backend_.upload(rope.inv_freq), rope.attention_factor};
  }

  int64_t weight_bytes_per_token() const override {
    int64_t bytes = int64_t(w_.embed.bytes() / size_t(w_.embed.n)) + int64_t(w_.lm_head.bytes());
    for (const LayerWeights& l : w_.layers) {
      bytes += int64_t(l.qkv.bytes() + l.q.bytes() + l.k.bytes() + l.v.bytes() + l.o.bytes());
      if (!l.is_moe) {
        bytes += int64_t(l.mlp.gate.bytes() + l.mlp.up.bytes() + l.mlp.down.bytes());
        continue;
      }
      int64_t experts = 0;
      for (const MlpWeights& e : l.moe.experts) experts += int64_t(e.gate.bytes() + e.up.bytes() + e.down.bytes());
      bytes += int64_t(l.moe.router.bytes()) + experts / int64_t(l.moe.experts.size()) * l.moe.top_k;
    }
    return bytes;
  }

  void compute(const Step& step) override {
    const auto& c = config_;
    Backend& be = backend_;
    const int64_t T = step.n_tokens, H = c.hidden_size, hd = c.head_dim;
    const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads;
    const float eps = float(c.rms_norm_eps);
    auto floats = [&](int64_t n) { return Buffer(be, size_t(n) * sizeof(float)); };
    const int64_t nq = nh * hd, nk = nkv * hd;
    // x is the residual stream. Norms are fused into the projections that read them and residual
    // adds into the projections that produce them (Backend::rms_norm_linear, linear_add,
    // rms_norm_moe_add), so a decode step has no separate norm or add kernels.
    Buffer x = floats(T * H), q = floats(T * nq);
    Buffer qkv = floats(T * (nq + 2 * nk));  // the projections, fused or one after another
    Buffer attn = floats(T * nh * hd);
    be.embed(w_.embed, step.ids, T, x.data());
    trace("embed", x.data(), T, H);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const LayerWeights& l = w_.layers[size_t(i)];
      const std::string name = "layers." + std::to_string(i);
      if (l.qkv.n) {  // rows [q | k | v] per token
        be.rms_norm_linear(x.data(), l.input_norm, eps, l.qkv, T, qkv.data());
        const float* row = qkv.data();
        be.qk_norm_rope_kv_write(row, q.data(), nq + 2 * nk, row + nq, row + nq + nk, nq + 2 * nk, l.q_norm,
                                 l.k_norm, eps, rope_, step.positions, T, nh, nkv, hd, step.kv_layer(i));
      } else {
        Buffer normed = floats(T * H);
        be.rms_norm(x.data(), l.input_norm, T, H, eps, normed.data());
        float* k_new = qkv.data() + T * nq;
        float* v_new = k_new + T * nk;
        be.linear(l.q, normed.data(), T, q.data());
        be.linear(l.k, normed.data(), T, k_new);
        be.linear(l.v, normed.data(), T, v_new);
        be.qk_norm_rope_kv_write(q.data(), q.data(), nq, k_new, v_new, nk, l.q_norm, l.k_norm, eps, rope_,
                                 step.positions, T, nh, nkv, hd, step.kv_layer(i));
      }
      trace(name + ".q", q.data(), T, nh * hd);
      attend(step, i, q.data(), nh, nkv, hd, 1.f / std::sqrt(float(hd)), attn.data());
      be.linear_add(l.o, attn.data(), T, x.data());
      trace(name + ".attn_residual", x.data(), T, H);
      if (l.is_moe) {
        be.rms_norm_moe_add(l.post_attention_norm, eps, l.moe, T, x.data());
      } else {
        const int64_t inter = l.mlp.gate.n;
        Buffer normed = floats(T * H), gate = floats(T * inter), up = floats(T * inter);
        be.rms_norm(x.data(), l.post_attention_norm, T, H, eps, normed.data());
        be.linear(l.mlp.gate, normed.data(), T, gate.data());
        be.linear(l.mlp.up, normed.data(), T, up.data());
        be.silu_mul(gate.data(), up.data(), T * inter, gate.data());
        be.linear_add(l.mlp.down, gate.data(), T, x.data());
      }
      trace(name + ".out", x.data(), T, H);
    }
    const int64_t rows = project_logits(step, x.data(), w_.final_norm, eps, w_.lm_head);
    trace("logits", step.logits, rows, c.vocab_size);
  }

 private:
  RopeTable rope_;
  ModelWeights w_;
};

}  // namespace

std::unique_ptr<Model> create_qwen3_moe(const ModelConfig& config, WeightSource& src,
                                        Backend& backend) {
  return std::make_unique<Qwen3Moe>(config, src, backend);
}

}  // namespace nibble
