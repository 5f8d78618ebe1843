// The blocks architectures share, built from Backend ops (model.h declares them on Model).
#include <cmath>

#include "model/model.h"

namespace nibble {

void Model::self_attention(const Step& step, int64_t layer, const LayerWeights& l, const RopeTable& rope, float* x,
                           AttentionBuffers& b, const WeightVector* moe_norm) const {
  const auto& c = config_;
  Backend& be = backend_;
  const int64_t T = step.n_tokens, H = c.hidden_size, hd = c.head_dim;
  const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, nq = nh * hd, nk = nkv * hd;
  const float eps = float(c.rms_norm_eps);
  if (!b.q.data()) {
    b.q = Buffer(be, size_t(T * nq) * 4);
    b.qkv = Buffer(be, size_t(T * (nq + 2 * nk)) * 4);
    b.out = Buffer(be, size_t(T * nq) * 4);
  }
  float *q = b.q.data(), *qkv = b.qkv.data();
  const std::string name = "layers." + std::to_string(layer);
  const float scale = 1.f / std::sqrt(float(hd));
  // A decode step (every token its sequence's one new token): the prologue and the attention as
  // one op, which a backend may fuse (the traced q is then never written).
  const bool decode = (step.cache ? T == 1 : step.segments.empty()) && !tracer_;
  bool attended = false;
  if (l.qkv.n) {  // rows [q | k | v] per token
    be.rms_norm_linear(x, l.input_norm, eps, l.qkv, T, qkv);
    if (decode) {
      be.qk_norm_rope_attention(qkv, nq + 2 * nk, qkv + nq, qkv + nq + nk, nq + 2 * nk, l.q_norm, l.k_norm, eps,
                                rope, step.positions, T, nh, nkv, hd, step.kv_layer(layer), step.max_context, scale,
                                q, b.out.data(), l.sinks.data, l.sliding_window);
      attended = true;
    } else {
      be.qk_norm_rope_kv_write(qkv, q, nq + 2 * nk, qkv + nq, qkv + nq + nk, nq + 2 * nk, l.q_norm, l.k_norm, eps,
                               rope, step.positions, T, nh, nkv, hd, step.kv_layer(layer));
    }
  } else {
    Buffer normed(be, size_t(T * H) * 4);
    be.rms_norm(x, l.input_norm, T, H, eps, normed.data());
    float* k_new = qkv + T * nq;
    float* v_new = k_new + T * nk;
    be.linear(l.q, normed.data(), T, q);
    be.linear(l.k, normed.data(), T, k_new);
    be.linear(l.v, normed.data(), T, v_new);
    be.qk_norm_rope_kv_write(q, q, nq, k_new, v_new, nk, l.q_norm, l.k_norm, eps, rope, step.positions, T, nh, nkv, hd,
                             step.kv_layer(layer));
  }
  if (!attended) {
    trace(name + ".q", q, T, nq);
    attend(step, layer, q, nh, nkv, hd, scale, b.out.data(), l.sinks.data, l.sliding_window);
  }
  if (moe_norm) {
    be.linear_add_rms_norm_moe_add(l.o, b.out.data(), *moe_norm, eps, l.moe, T, x);
    return;
  }
  be.linear_add(l.o, b.out.data(), T, x);
  trace(name + ".attn_residual", x, T, H);
}

int64_t weight_bytes_per_token(const ModelWeights& w) {
  int64_t bytes = int64_t(w.embed.bytes() / size_t(w.embed.n)) + int64_t(w.lm_head.bytes());
  auto mlp_bytes = [](const MlpWeights& m) {
    return int64_t(m.gate.bytes() + m.up.bytes() + m.gate_up.bytes() + m.down.bytes());
  };
  for (const LayerWeights& l : w.layers) {
    bytes += int64_t(l.qkv.bytes() + l.q.bytes() + l.k.bytes() + l.v.bytes() + l.o.bytes());
    if (!l.is_moe) {
      bytes += mlp_bytes(l.mlp);
      continue;
    }
    int64_t experts = 0;
    for (const MlpWeights& e : l.moe.experts) experts += mlp_bytes(e);
    bytes += int64_t(l.moe.router.bytes()) + experts / int64_t(l.moe.experts.size()) * l.moe.top_k;
  }
  return bytes;
}

}  // namespace nibble
