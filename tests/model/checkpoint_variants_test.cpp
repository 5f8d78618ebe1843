// The same weights stored the other ways real checkpoints store them must give the same logits as
// the transformers reference: F16 instead of BF16, sharded with an index, AutoRound's config
// spelling of GPTQ, and transformers 5's fused expert tensors.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "format/safetensors.h"
#include "format/safetensors_writer.h"
#include "model/model.h"

namespace nibble {
namespace {
namespace fs = std::filesystem;

std::string fixture(const std::string& name) { return std::string(NIBBLE_FIXTURES_DIR) + "/models/" + name; }

class VariantTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = fs::temp_directory_path() / ("nibble_variant_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(tmp_);
    fs::create_directories(tmp_);
  }
  void TearDown() override { fs::remove_all(tmp_); }

  // Copies the fixture's non-weight files; the test writes the weights.
  std::string prepare(const std::string& name) {
    for (auto& e : fs::directory_iterator(fixture(name)))
      if (e.path().filename() != "model.safetensors") fs::copy_file(e.path(), tmp_ / e.path().filename());
    return tmp_.string();
  }

  // Max relative error of the model in `dir` against the fixture's transformers logits (f32 KV
  // cache: the exact path, so any loader mistake shows above the 1e-4 bound).
  double error_against(const std::string& dir, const std::string& reference) {
    auto expected = SafetensorsFile::open(fixture(reference) + "/expected.safetensors");
    const TensorInfo& p = expected->tensors().at("prompt_ids");
    const TensorInfo& l = expected->tensors().at("logits");
    std::vector<int32_t> prompt(size_t(p.numel()));
    std::memcpy(prompt.data(), p.data, p.nbytes);
    auto backend = make_cpu_backend();
    LoadOptions options;
    options.kv_cache_dtype = DType::F32;
    auto model = load_model(dir, *backend, options);
    KvCache kv = model->make_kv_cache(int64_t(prompt.size()));
    std::vector<float> logits;
    model->forward(prompt, 0, kv, true, logits);
    const float* want = reinterpret_cast<const float*>(l.data);
    double diff = 0, ref = 0;
    for (size_t i = 0; i < logits.size(); ++i) {
      diff = std::max(diff, double(std::fabs(logits[i] - want[i])));
      ref = std::max(ref, double(std::fabs(want[i])));
    }
    return diff / ref;
  }
  fs::path tmp_;
};

std::vector<uint8_t> raw(const TensorInfo& t) { return {t.data, t.data + t.nbytes}; }

TEST_F(VariantTest, F16Weights) {
  const std::string dir = prepare("tiny-qwen3-moe");
  auto src = SafetensorsFile::open(fixture("tiny-qwen3-moe") + "/model.safetensors");
  SafetensorsWriter w;
  for (auto& [name, t] : src->tensors()) {
    ASSERT_EQ(t.dtype, DType::BF16);
    const TensorInfo* info = &t;
    w.add(name, DType::F16, t.shape, [info] {
      std::vector<uint16_t> out(size_t(info->numel()));
      const uint16_t* in = reinterpret_cast<const uint16_t*>(info->data);
      for (size_t i = 0; i < out.size(); ++i) out[i] = f32_to_f16(bf16_to_f32(in[i]));
      return to_bytes(out);
    });
  }
  w.write(dir + "/model.safetensors", {});
  EXPECT_LE(error_against(dir, "tiny-qwen3-moe"), 1e-4);
}

TEST_F(VariantTest, ShardedWithIndex) {
  const std::string dir = prepare("tiny-qwen3-moe-int4-g32");
  auto src = SafetensorsFile::open(fixture("tiny-qwen3-moe-int4-g32") + "/model.safetensors");
  SafetensorsWriter shard[2];
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  int i = 0;
  for (auto& [name, t] : src->tensors()) {
    const int s = (i++ / 7) % 2;  // interleave runs of tensors over the shards
    const TensorInfo* info = &t;
    shard[s].add(name, t.dtype, t.shape, [info] { return raw(*info); });
    index["weight_map"][name] = fmt::format("model-0000{}-of-00002.safetensors", s + 1);
  }
  shard[0].write(dir + "/model-00001-of-00002.safetensors", {});
  shard[1].write(dir + "/model-00002-of-00002.safetensors", {});
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump();
  EXPECT_LE(error_against(dir, "tiny-qwen3-moe-int4-g32"), 1e-4);
}

TEST_F(VariantTest, AutoRoundConfigSpelling) {
  const std::string dir = prepare("tiny-qwen3-int4-g64-asym");
  fs::copy_file(fixture("tiny-qwen3-int4-g64-asym") + "/model.safetensors", dir + "/model.safetensors");
  nlohmann::json config = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
  // What auto-round writes for GPTQ-packed int4 (no desc_act key, its own metadata).
  config["quantization_config"] = {{"quant_method", "auto-round"}, {"packing_format", "auto_round:auto_gptq"},
                                   {"bits", 4}, {"group_size", 64}, {"sym", false}, {"data_type", "int"},
                                   {"iters", 200}, {"block_name_to_quantize", "model.layers"}};
  std::ofstream(dir + "/config.json") << config.dump();
  EXPECT_LE(error_against(dir, "tiny-qwen3-int4-g64-asym"), 1e-4);
  // The same file read as GPTQ v2 (zeros stored without the -1) must be wrong: the test can fail.
  config["quantization_config"] = {{"quant_method", "gptq"}, {"checkpoint_format", "gptq_v2"}, {"bits", 4},
                                   {"group_size", 64}, {"sym", false}};
  std::ofstream(dir + "/config.json") << config.dump();
  EXPECT_GT(error_against(dir, "tiny-qwen3-int4-g64-asym"), 1e-2);
}

TEST_F(VariantTest, FusedExpertTensors) {
  const std::string dir = prepare("tiny-qwen3-moe");
  auto src = SafetensorsFile::open(fixture("tiny-qwen3-moe") + "/model.safetensors");
  const auto& tensors = src->tensors();
  SafetensorsWriter w;
  for (auto& [name, t] : tensors) {
    if (name.find(".mlp.experts.") != std::string::npos) continue;
    const TensorInfo* info = &t;
    w.add(name, t.dtype, t.shape, [info] { return raw(*info); });
  }
  for (int layer : {0, 2}) {
    const std::string p = "model.layers." + std::to_string(layer) + ".mlp.experts.";
    w.add(p + "gate_up_proj", DType::BF16, {7, 96, 96}, [&tensors, p] {
      std::vector<uint8_t> out;
      for (int e = 0; e < 7; ++e)
        for (const char* m : {"gate_proj", "up_proj"}) {
          auto b = raw(tensors.at(p + std::to_string(e) + "." + m + ".weight"));
          out.insert(out.end(), b.begin(), b.end());
        }
      return out;
    });
    w.add(p + "down_proj", DType::BF16, {7, 96, 48}, [&tensors, p] {
      std::vector<uint8_t> out;
      for (int e = 0; e < 7; ++e) {
        auto b = raw(tensors.at(p + std::to_string(e) + ".down_proj.weight"));
        out.insert(out.end(), b.begin(), b.end());
      }
      return out;
    });
  }
  w.write(dir + "/model.safetensors", {});
  EXPECT_LE(error_against(dir, "tiny-qwen3-moe"), 1e-4);
}

}  // namespace
}  // namespace nibble
