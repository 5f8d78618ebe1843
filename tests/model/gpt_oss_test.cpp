// gpt-oss on the CPU reference, on the tiny MXFP4 checkpoint tools/make_gpt_oss_fixture.py writes
// (tests/fixtures/models/tiny-gpt-oss-mxfp4: sliding window 5 on layers 0 and 2, sinks, biases,
// YaRN, 5 experts top 2 in MXFP4). What is checked here holds whatever transformers computes:
// the KV cache path (chunked prefill, one token at a time, a reversed paged table, a batch over a
// shared pool) gives the logits of one full forward pass, across the window's edge; the loader
// reads the experts exactly as stored and names what is wrong in a malformed checkpoint; dummy
// and quantize-at-load MXFP4 weights run. The comparison with transformers' own GptOssForCausalLM
// is FixtureTest's, once `make_gpt_oss_fixture.py reference` has written expected.safetensors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>

#include "core/status.h"
#include "format/safetensors.h"
#include "format/safetensors_writer.h"
#include "model/model.h"
#include "reference_outputs.h"

namespace nibble {
namespace {

namespace fs = std::filesystem;

const std::string kDir = std::string(NIBBLE_FIXTURES_DIR) + "/models/tiny-gpt-oss-mxfp4";

std::vector<int32_t> test_tokens(int64_t n, int64_t vocab) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(int32_t((i * 7919 + 13) % (vocab - 16)));
  return t;
}

// On each backend this machine has (a GPU's tests are skipped without one). f32 KV, so on the CPU
// the paths differ only in summation order (1e-5); on the GPU decode shapes round the activations
// to f16 in the MXFP4 kernels and prefill shapes do not: each path lands about 1e-3 from the
// exact logits (FixtureTest), two paths up to 3.9e-3 apart (measured, H100), so 5e-3 there. A
// window or sink applied wrongly moves the logits by over 1e-1.
class GptOssTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    try {
      backend_ = make_backend(GetParam());
    } catch (const Error& e) {
      GTEST_SKIP() << e.what();
    }
    model_ = load_model(kDir, *backend_);
    model_->set_kv_dtype(DType::F32);
    tolerance_ = GetParam() == "cpu" ? 1e-5 : 5e-3;
  }
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Model> model_;
  double tolerance_ = 1e-5;
};

TEST_P(GptOssTest, ConfigAndWeightsAsStored) {
  const ModelConfig& c = model_->config();
  EXPECT_EQ(c.model_type, "gpt_oss");
  EXPECT_EQ(c.layer_window(0), 5);
  EXPECT_EQ(c.layer_window(1), 0);
  EXPECT_EQ(c.quant.method, "mxfp4");
  // Per token: one embedding row (BF16), q/k/v/o with biases, the router, 2 of 5 experts in MXFP4
  // (4.25 bits a weight) with f32 biases not counted, the lm_head.
  const int64_t H = 96, I = 64, q = 6 * 24, kv = 2 * 24;
  const int64_t attn = 2 * (q + 2 * kv) * H + 2 * H * q;
  const int64_t experts = 2 * (2 * I * H + H * I) * 17 / 32;
  const int64_t want = 2 * H + 3 * (attn + 2 * 5 * H + experts) + 2 * 400 * H;
  EXPECT_EQ(model_->weight_bytes_per_token(), want);
}

// 44 tokens (the fixture's 12 + 32) through one forward pass vs. the cache paths: positions far
// past the window of 5, so a window applied wrongly on either side shows.
TEST_P(GptOssTest, CachePathsMatchOneFullPass) {
  const int64_t vocab = model_->config().vocab_size, n = 44;
  const std::vector<int32_t> tokens = test_tokens(n, vocab);
  KvCache full = model_->make_kv_cache(n);
  std::vector<float> want, got;
  model_->forward(tokens, 0, full, true, want);
  ASSERT_EQ(want.size(), size_t(n * vocab));

  // One at a time after a 12-token prompt, through blocks of 2 positions in reverse pool order.
  KvCache kv = model_->make_kv_cache(n, 1);
  std::vector<int32_t> table(static_cast<size_t>(kv.n_blocks()));
  for (size_t b = 0; b < table.size(); ++b) table[b] = int32_t(table.size() - 1 - b);
  kv.set_block_table(table);
  std::span<const int32_t> all(tokens);
  model_->forward(all.first(12), 0, kv, false, got);
  EXPECT_LE(test::normalized_error(got.data(), want.data() + 11 * vocab, size_t(vocab)), tolerance_) << "prompt";
  for (int64_t p = 12; p < n; ++p) {
    model_->forward(all.subspan(size_t(p), 1), p, kv, false, got);
    ASSERT_LE(test::normalized_error(got.data(), want.data() + p * vocab, size_t(vocab)), tolerance_)
        << "position " << p;
  }

  // Chunks of 9: every chunk's queries see keys of the previous chunk inside their window.
  KvCache chunked = model_->make_kv_cache(n);
  for (int64_t p = 0; p < n; p += 9) {
    const int64_t len = std::min<int64_t>(9, n - p);
    model_->forward(all.subspan(size_t(p), size_t(len)), p, chunked, true, got);
    EXPECT_LE(test::normalized_error(got.data(), want.data() + p * vocab, size_t(len * vocab)), tolerance_)
        << "chunk at " << p;
  }
}

// The sliding layers in a ring (KvCache's ring_chunk small enough that 44 positions wrap it
// several times): the whole sequence in one call (split by forward into chunks), the prompt then
// one token at a time, and odd chunk sizes give the full cache's logits.
TEST_P(GptOssTest, RingCacheForSlidingLayersMatchesFullCache) {
  const int64_t vocab = model_->config().vocab_size, n = 44;
  const std::vector<int32_t> tokens = test_tokens(n, vocab);
  std::span<const int32_t> all(tokens);
  KvCache full = model_->make_kv_cache(n);
  std::vector<float> want, got;
  model_->forward(tokens, 0, full, true, want);

  for (int log2 : {0, 1, 2}) {
    // Window 5 + chunk 6: rings of 11..13 positions.
    KvCache ring = model_->make_kv_cache(n, log2, 6);
    ASSERT_GT(ring.ring_blocks(), 0);
    EXPECT_LE(ring.ring_blocks() << log2, 16) << "block 2^" << log2;
    EXPECT_GE(ring.max_chunk(), 6);
    EXPECT_LT(ring.bytes(), full.bytes());
    model_->forward(tokens, 0, ring, true, got);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_LE(test::normalized_error(got.data(), want.data(), want.size()), tolerance_) << "one call, 2^" << log2;

    KvCache steps = model_->make_kv_cache(n, log2, 6);
    model_->forward(all.first(12), 0, steps, false, got);
    EXPECT_LE(test::normalized_error(got.data(), want.data() + 11 * vocab, size_t(vocab)), tolerance_) << "prompt";
    for (int64_t p = 12; p < n; ++p) {
      model_->forward(all.subspan(size_t(p), 1), p, steps, false, got);
      ASSERT_LE(test::normalized_error(got.data(), want.data() + p * vocab, size_t(vocab)), tolerance_)
          << "position " << p << ", 2^" << log2;
    }
    KvCache chunks = model_->make_kv_cache(n, log2, 6);
    for (int64_t p = 0, len = 1; p < n; p += len, len = len % 7 + 2) {
      len = std::min(len, n - p);
      model_->forward(all.subspan(size_t(p), size_t(len)), p, chunks, true, got);
      ASSERT_LE(test::normalized_error(got.data(), want.data() + p * vocab, size_t(len * vocab)), tolerance_)
          << "chunk at " << p << " of " << len << ", 2^" << log2;
    }
  }
}

TEST_P(GptOssTest, BatchOverASharedPoolMatchesAlone) {
  const int64_t vocab = model_->config().vocab_size;
  const std::vector<int32_t> a = test_tokens(30, vocab);
  std::vector<int32_t> b = test_tokens(23, vocab);
  for (auto& t : b) t = int32_t((t + 101) % vocab);
  auto alone = [&](const std::vector<int32_t>& t, int64_t upto) {
    KvCache kv = model_->make_kv_cache(int64_t(t.size()));
    std::vector<float> logits;
    model_->forward(std::span<const int32_t>(t).first(size_t(upto)), 0, kv, false, logits);
    return logits;
  };
  auto pool = model_->make_kv_pool(16, 2, 2, 8);
  pool->set_row(0, {1, 2, 3, 4, 5, 6, 7, 8});
  pool->set_row(1, {15, 14, 13, 12, 11, 10, 9});
  // Step 1: a's first 29 tokens and b's first 20 as prompt chunks; step 2: one token each plus
  // b's next two as a chunk in a step of its own.
  BatchOutput out;
  std::vector<BatchEntry> step1(2);
  step1[0].tokens = std::span<const int32_t>(a).first(29);
  step1[0].row = 0;
  step1[0].output = BatchEntry::Output::kLogits;
  step1[1].tokens = std::span<const int32_t>(b).first(20);
  step1[1].row = 1;
  step1[1].output = BatchEntry::Output::kLogits;
  model_->forward_batch(step1, *pool, out);
  ASSERT_EQ(out.logits.size(), size_t(2 * vocab));
  EXPECT_LE(test::normalized_error(out.logits.data(), alone(a, 29).data(), size_t(vocab)), tolerance_);
  EXPECT_LE(test::normalized_error(out.logits.data() + vocab, alone(b, 20).data(), size_t(vocab)), tolerance_);
  std::vector<BatchEntry> step2(2);
  step2[0].tokens = std::span<const int32_t>(a).subspan(29, 1);
  step2[0].pos0 = 29;
  step2[0].row = 0;
  step2[0].output = BatchEntry::Output::kLogits;
  step2[1].tokens = std::span<const int32_t>(b).subspan(20, 3);
  step2[1].pos0 = 20;
  step2[1].row = 1;
  step2[1].output = BatchEntry::Output::kLogits;
  model_->forward_batch(step2, *pool, out);
  EXPECT_LE(test::normalized_error(out.logits.data(), alone(a, 30).data(), size_t(vocab)), tolerance_);
  EXPECT_LE(test::normalized_error(out.logits.data() + vocab, alone(b, 23).data(), size_t(vocab)), tolerance_);
}

INSTANTIATE_TEST_SUITE_P(Backends, GptOssTest, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

// A tensor as a rewritten copy of the fixture stores it.
struct Stored {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// A copy of the fixture whose tensors `edit` may change or drop (returning false).
struct EditedCheckpoint {
  fs::path dir;
  EditedCheckpoint(const std::string& tag, const std::function<bool(const TensorInfo&, Stored&)>& edit) {
    dir = fs::temp_directory_path() / ("nibble_gpt_oss_" + tag);
    fs::remove_all(dir);
    fs::create_directories(dir);
    for (const char* f : {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"})
      fs::copy_file(kDir + "/" + f, dir / f);
    Checkpoint ckpt = Checkpoint::open(kDir);
    SafetensorsWriter w;
    for (auto& [name, t] : ckpt.tensors()) {
      Stored out{name, t->dtype, t->shape, std::vector<uint8_t>(t->data, t->data + t->nbytes)};
      if (!edit(*t, out)) continue;
      w.add(out.name, out.dtype, out.shape, [bytes = std::move(out.bytes)] { return bytes; });
    }
    w.write((dir / "model.safetensors").string(), {{"format", "pt"}});
  }
  ~EditedCheckpoint() { fs::remove_all(dir); }
};

std::string load_error(const fs::path& dir) {
  auto backend = make_cpu_backend();
  try {
    load_model(dir.string(), *backend);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(GptOssCheckpoint, MalformedExpertsAreNamed) {
  const std::string scales = "model.layers.1.mlp.experts.down_proj_scales";
  {
    EditedCheckpoint c("missing", [&](const TensorInfo& t, Stored&) { return t.name != scales; });
    const std::string e = load_error(c.dir);
    EXPECT_NE(e.find(scales), std::string::npos) << e;
    EXPECT_NE(e.find("missing"), std::string::npos) << e;
  }
  {  // blocks of 16 experts' worth of rows split differently: [5, 128, 3, 16] -> [5, 64, 6, 16]
    const std::string blocks = "model.layers.0.mlp.experts.gate_up_proj_blocks";
    EditedCheckpoint c("shape", [&](const TensorInfo& t, Stored& out) {
      if (t.name == blocks) out.shape = {5, 64, 6, 16};
      return true;
    });
    const std::string e = load_error(c.dir);
    EXPECT_NE(e.find(blocks), std::string::npos) << e;
    EXPECT_NE(e.find("[5, 64, 6, 16]"), std::string::npos) << e;
  }
  {  // the blocks as 16-bit values: same bytes, another dtype
    const std::string blocks = "model.layers.2.mlp.experts.down_proj_blocks";
    EditedCheckpoint c("dtype", [&](const TensorInfo& t, Stored& out) {
      if (t.name == blocks) out.dtype = DType::BF16, out.shape.back() = 8;
      return true;
    });
    const std::string e = load_error(c.dir);
    EXPECT_NE(e.find(blocks), std::string::npos) << e;
    EXPECT_NE(e.find("BF16"), std::string::npos) << e;
  }
  {  // sinks absent: an older or edited export
    EditedCheckpoint c("sinks", [&](const TensorInfo& t, Stored&) {
      return t.name != "model.layers.0.self_attn.sinks";
    });
    const std::string e = load_error(c.dir);
    EXPECT_NE(e.find("model.layers.0.self_attn.sinks"), std::string::npos) << e;
  }
}

// The experts as a dense checkpoint in transformers' layout ([E, H, 2I], inputs first, as BF16
// gpt-oss exports store them) load to the same model as the MXFP4 one they were dequantized from.
TEST(GptOssCheckpoint, DenseExpertsInTransformersLayout) {
  Checkpoint ckpt = Checkpoint::open(kDir);
  EditedCheckpoint c("dense", [&](const TensorInfo& t, Stored& out) {
    if (t.name.ends_with("_scales")) return false;
    if (!t.name.ends_with("_blocks")) return true;
    const std::string base = t.name.substr(0, t.name.size() - 7);  // transformers' name
    const TensorInfo& s = ckpt.get(base + "_scales");
    const int64_t E = t.shape[0], n = t.shape[1], k = t.shape[2] * 32;
    std::vector<float> row(static_cast<size_t>(k));
    std::vector<uint16_t> w(size_t(E * n * k));
    for (int64_t e = 0; e < E; ++e)
      for (int64_t o = 0; o < n; ++o) {
        dequantize_mxfp4_row(t.data + e * n * k / 2, s.data + e * n * k / 32, k, o, row.data());
        for (int64_t i = 0; i < k; ++i) w[size_t((e * k + i) * n + o)] = f32_to_bf16(row[size_t(i)]);
      }
    out = {base, DType::BF16, {E, k, n}, to_bytes(w)};
    return true;
  });
  nlohmann::json config = read_json_file((c.dir / "config.json").string());
  config.erase("quantization_config");
  std::ofstream(c.dir / "config.json") << config.dump();

  auto backend = make_cpu_backend();
  auto mxfp4 = load_model(kDir, *backend), dense = load_model(c.dir.string(), *backend);
  const std::vector<int32_t> tokens = test_tokens(20, mxfp4->config().vocab_size);
  std::vector<float> a, b;
  for (auto* m : {mxfp4.get(), dense.get()}) m->set_kv_dtype(DType::F32);
  KvCache ka = mxfp4->make_kv_cache(20), kb = dense->make_kv_cache(20);
  mxfp4->forward(tokens, 0, ka, true, a);
  dense->forward(tokens, 0, kb, true, b);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_LE(test::normalized_error(b.data(), a.data(), a.size()), 1e-6);
}

// --quantize-layers qkv,lm_head --quantize-format mxfp4: the projections read in 4 bits; the
// logits stay near the BF16 ones (the error is printed, not hidden). The fixture's o_proj has 144
// inputs, not a whole number of MXFP4 blocks: asking for it is an Error naming the module.
TEST(GptOssCheckpoint, QuantizeAttentionAndHeadToMxfp4) {
  auto backend = make_cpu_backend();
  LoadOptions o;
  o.quantize_layers = {"qkv", "lm_head"};
  o.quantize_format = "mxfp4";
  auto q = load_model(kDir, *backend, o), base = load_model(kDir, *backend);
  // BF16 -> 4.25 bits for qkv and the head (the larger part of what a token reads here).
  EXPECT_LT(q->weight_bytes_per_token(), base->weight_bytes_per_token() * 3 / 5);
  // The logit error of the quantized head alone (this random model amplifies errors in its
  // attention inputs chaotically: ~1 for MXFP4 qkv, ~0.6 for INT4 g32 qkv, so those say nothing).
  o.quantize_layers = {"lm_head"};
  q = load_model(kDir, *backend, o);
  const std::vector<int32_t> tokens = test_tokens(16, base->config().vocab_size);
  std::vector<float> a, b;
  KvCache ka = base->make_kv_cache(16), kb = q->make_kv_cache(16);
  base->forward(tokens, 0, ka, true, a);
  q->forward(tokens, 0, kb, true, b);
  const double err = test::normalized_error(b.data(), a.data(), a.size());
  std::cout << "MXFP4 lm_head: max relative logit error " << err << "\n";  // 0.109 (INT4 g32: 0.070)
  EXPECT_GT(err, 1e-3);  // it did quantize
  EXPECT_LT(err, 0.2);
  o.quantize_layers = {"o"};
  try {
    load_model(kDir, *backend, o);
    ADD_FAILURE() << "o_proj with 144 inputs quantized to MXFP4";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("self_attn.o_proj"), std::string::npos) << e.what();
  }
  o.quantize_format = "nf4";
  EXPECT_THROW(load_model(kDir, *backend, o), Error);
}

TEST(GptOssCheckpoint, DummyMxfp4Weights) {
  auto backend = make_cpu_backend();
  LoadOptions o;
  o.load_format = "dummy";
  o.quantization = "mxfp4";
  const fs::path dir = fs::temp_directory_path() / "nibble_gpt_oss_dummy";
  fs::create_directories(dir);
  nlohmann::json config = read_json_file(kDir + "/config.json");
  config.erase("quantization_config");
  std::ofstream(dir / "config.json") << config.dump();
  auto model = load_model(dir.string(), *backend, o);
  KvCache kv = model->make_kv_cache(8);
  std::vector<float> logits;
  model->forward(test_tokens(8, 400), 0, kv, false, logits);
  for (float v : logits) ASSERT_TRUE(std::isfinite(v));
  // gpt-oss's own config (quantization_config mxfp4) gets MXFP4 dummy experts without asking.
  o.quantization.clear();
  EXPECT_EQ(load_model(kDir, *backend, o)->weight_bytes_per_token(), model->weight_bytes_per_token());
  // --quantize-layers with --quantize-format mxfp4 makes those layers MXFP4 (not INT4) dummies:
  // q/k/v and the lm_head at 17 bytes per 32 weights instead of 64. o_proj's 144 inputs are not
  // whole MXFP4 blocks: an error that names it.
  {
    LoadOptions q = o;
    q.quantization = "mxfp4";
    q.quantize_format = "mxfp4";
    q.quantize_layers = {"o"};
    try {
      load_model(dir.string(), *backend, q);
      ADD_FAILURE() << "o_proj with 144 inputs quantized to MXFP4";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("o_proj' has 144 inputs"), std::string::npos) << e.what();
    }
    q.quantize_layers = {"qkv", "lm_head"};
    auto quantized = load_model(dir.string(), *backend, q);
    const int64_t H = 96, qd = 6 * 24, kvd = 2 * 24, attn = (qd + 2 * kvd) * H, head = 400 * H;
    EXPECT_EQ(model->weight_bytes_per_token() - quantized->weight_bytes_per_token(),
              3 * (2 * attn - attn * 17 / 32) + (2 * head - head * 17 / 32));
    KvCache kq = quantized->make_kv_cache(8);
    quantized->forward(test_tokens(8, 400), 0, kq, false, logits);
    for (float v : logits) ASSERT_TRUE(std::isfinite(v));
  }
  o.quantization = "int4";
  EXPECT_THROW(load_model(kDir, *backend, o), Error);  // the config says MXFP4
  o.quantization = "mxfp4";
  // MXFP4 dummy weights are for gpt-oss's experts only.
  std::ofstream(dir / "config.json") << R"({"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 32})";
  EXPECT_THROW(load_model(dir.string(), *backend, o), Error);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace nibble
