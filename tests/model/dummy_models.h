// Configs for models with dummy weights (--load-format dummy) that tests build on the fly.
#pragma once

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace nibble {

// A small Qwen3-MoE config whose sizes are multiples of 256, so the GPU takes its decode layouts
// (interleaved INT4, fused MoE) rather than the exact fallbacks the odd-sized fixtures use.
inline std::string decode_shaped_config() {
  const auto dir = std::filesystem::temp_directory_path() / "nibble_dummy_decode_shaped";
  std::filesystem::create_directories(dir);
  nlohmann::json c = {{"model_type", "qwen3_moe"}, {"vocab_size", 1000}, {"hidden_size", 512},
                      {"intermediate_size", 768}, {"moe_intermediate_size", 256}, {"num_hidden_layers", 2},
                      {"num_attention_heads", 8}, {"num_key_value_heads", 2}, {"head_dim", 64},
                      {"num_experts", 16}, {"num_experts_per_tok", 4}, {"norm_topk_prob", true},
                      {"max_position_embeddings", 4096}, {"rope_theta", 1e6}, {"rms_norm_eps", 1e-6},
                      {"tie_word_embeddings", false}};
  std::ofstream(dir / "config.json") << c.dump();
  return dir.string();
}

}  // namespace nibble
