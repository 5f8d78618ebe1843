// Qwen3 and Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B; dense Qwen3 is the same graph with a
// SwiGLU MLP in every layer). Per layer:
//   h = x + o_proj(attn(rope(q_norm(q_proj(n1))), rope(k_norm(k_proj(n1))), v_proj(n1)))   n1 = rms(x)
//   x = h + mlp(rms(h))      mlp = MoE (softmax router, top-k, renormalised) or dense SwiGLU
// Shapes: [T, H] hidden rows, q [T, n_head, hd], k/v [T, n_head_kv, hd]; hd need not be H/n_head.
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

  int64_t weight_bytes_per_token() const override { return nibble::weight_bytes_per_token(w_); }

  void compute(const Step& step) override {
    const auto& c = config_;
    Backend& be = backend_;
    const int64_t T = step.n_tokens, H = c.hidden_size;
    const float eps = float(c.rms_norm_eps);
    auto floats = [&](int64_t n) { return Buffer(be, size_t(n) * sizeof(float)); };
    // x is the residual stream. Norms are fused into the projections that read them and residual
    // adds into the projections that produce them (Backend::rms_norm_linear, linear_add,
    // rms_norm_moe_add), so a decode step has no separate norm or add kernels.
    Buffer x = floats(T * H);
    AttentionBuffers attention;
    be.embed(w_.embed, step.ids, T, x.data());
    trace("embed", x.data(), T, H);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const LayerWeights& l = w_.layers[size_t(i)];
      // The o projection and the MoE block as one op where no tracer reads the residual between.
      const bool fused_moe = l.is_moe && !tracing();
      self_attention(step, i, l, rope_, x.data(), attention, fused_moe ? &l.post_attention_norm : nullptr);
      if (fused_moe) {
        // done by self_attention
      } else if (l.is_moe) {
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
      trace("layers." + std::to_string(i) + ".out", x.data(), T, H);
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
