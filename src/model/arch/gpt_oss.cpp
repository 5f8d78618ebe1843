// gpt-oss (gpt-oss-20b, gpt-oss-120b). Per layer:
//   h = x + o_proj(attn(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1); sinks, window))   n1 = rms(x)
//   x = h + moe(rms(h))
// What differs from Qwen3-MoE (transformers' modular_gpt_oss.py, openai/gpt-oss model.py):
// - q/k/v/o have biases; no q/k norm; RoPE is the half-split form with YaRN as configured.
// - attention: a learned sink logit per q head joins every softmax; layer_types make even layers
//   attend to a sliding window of the last `sliding_window` positions.
// - router: a Linear with bias; top-k of the raw logits, softmax over the k selected (the same
//   weights as softmax-then-renormalise, which is what Backend::moe_route computes).
// - experts: fused over experts with biases, gate/up rows interleaved, clamped SwiGLU
//   (up + 1) · g · sigmoid(1.702 g) with g = min(gate, limit), up clamped to ±limit.
// The checkpoint ships experts in MXFP4 (format/quant/mxfp4.h) and everything else in BF16.
#include "core/status.h"
#include "model/arch/registry.h"

namespace nibble {
namespace {

class GptOss final : public Model {
 public:
  GptOss(const ModelConfig& config, WeightSource& src, Backend& backend) : Model(config, backend) {
    const auto& c = config_;
    const int64_t hd = c.head_dim, H = c.hidden_size, nh = c.num_attention_heads, nkv = c.num_key_value_heads;
    NIBBLE_CHECK(c.num_experts > 0, "{}: gpt_oss needs num_local_experts > 0", c.path);
    auto linear = [&](const std::string& name, int64_t n, int64_t k, bool bias) {
      return src.linear(name, n, k, bias);
    };
    w_.embed = linear("model.embed_tokens", c.vocab_size, H, false);
    NIBBLE_CHECK(w_.embed.format != WeightFormat::kInt4 && w_.embed.format != WeightFormat::kMxfp4,
                 "{}: quantized embeddings are not supported", c.path);
    w_.layers.resize(size_t(c.num_hidden_layers));
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i);
      LayerWeights& l = w_.layers[size_t(i)];
      l.input_norm = src.vector(p + ".input_layernorm.weight", H);
      l.post_attention_norm = src.vector(p + ".post_attention_layernorm.weight", H);
      l.q = linear(p + ".self_attn.q_proj", nh * hd, H, c.attention_bias);
      l.k = linear(p + ".self_attn.k_proj", nkv * hd, H, c.attention_bias);
      l.v = linear(p + ".self_attn.v_proj", nkv * hd, H, c.attention_bias);
      l.o = linear(p + ".self_attn.o_proj", H, nh * hd, c.attention_bias);
      if (auto qkv = backend_.concat_rows({&l.q, &l.k, &l.v})) {
        l.qkv = std::move(*qkv);
        l.q = l.k = l.v = LinearWeight{};
      }
      l.sinks = src.vector(p + ".self_attn.sinks", nh);
      l.sliding_window = c.layer_window(i);
      l.is_moe = true;
      l.moe.router = linear(p + ".mlp.router", c.num_experts, H, true);
      l.moe.top_k = c.num_experts_per_tok;
      l.moe.normalize = true;
      l.moe.activation = MoeActivation::kClampedSwiglu;
      l.moe.swiglu_alpha = 1.702f;  // fixed in transformers and openai/gpt-oss, not in config.json
      l.moe.swiglu_limit = float(c.swiglu_limit > 0 ? c.swiglu_limit : 7.0);
      l.moe.experts = src.gpt_oss_experts(p + ".mlp.experts", c.num_experts, c.moe_intermediate_size, H);
    }
    w_.final_norm = src.vector("model.norm.weight", H);
    if (c.tie_word_embeddings && !src.has("lm_head"))
      w_.lm_head = src.quantizes("lm_head") ? src.linear("model.embed_tokens", c.vocab_size, H, false, "lm_head")
                                            : w_.embed;
    else
      w_.lm_head = linear("lm_head", c.vocab_size, H, false);
    RopeTable rope = make_rope_table(c);
    rope_ = {backend_.upload(rope.inv_freq), rope.attention_factor};
  }

  int64_t weight_bytes_per_token() const override { return nibble::weight_bytes_per_token(w_); }

  void compute(const Step& step) override {
    const auto& c = config_;
    const int64_t T = step.n_tokens, H = c.hidden_size;
    const float eps = float(c.rms_norm_eps);
    Buffer x(backend_, size_t(T * H) * sizeof(float));  // the residual stream
    AttentionBuffers attention;
    backend_.embed(w_.embed, step.ids, T, x.data());
    trace("embed", x.data(), T, H);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      const LayerWeights& l = w_.layers[size_t(i)];
      // No q/k norms (l has none). The o projection and the MoE block as one op where no tracer
      // reads the residual between (a backend may fold the router into o).
      const bool fused_moe = !tracing();
      self_attention(step, i, l, rope_, x.data(), attention, fused_moe ? &l.post_attention_norm : nullptr);
      if (!fused_moe) backend_.rms_norm_moe_add(l.post_attention_norm, eps, l.moe, T, x.data());
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

std::unique_ptr<Model> create_gpt_oss(const ModelConfig& config, WeightSource& src, Backend& backend) {
  return std::make_unique<GptOss>(config, src, backend);
}

}  // namespace nibble
