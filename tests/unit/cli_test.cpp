// The nibble binary end to end: what users see on good input, and on bad input a clear error that
// names the file and the field, a non-zero exit and no crash (a signal would fail these tests).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <functional>
#include <set>
#include <sstream>
#include <unistd.h>
#include <fstream>
#include <nlohmann/json.hpp>

#include "format/safetensors.h"
#include "format/safetensors_writer.h"
#include "tokenizer/tokenizer.h"

namespace nibble {
namespace {
namespace fs = std::filesystem;

struct Result {
  int exit_code = -1;
  bool crashed = false;
  std::string output;  // stdout and stderr together
};

Result run_nibble(const std::string& args) {
  Result r;
  const std::string cmd = std::string(NIBBLE_BINARY) + " " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) r.output.append(buf, n);
  int status = pclose(pipe);
  r.crashed = !WIFEXITED(status);
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  return r;
}

std::string fixture(const std::string& name) { return std::string(NIBBLE_FIXTURES_DIR) + "/models/" + name; }

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = fs::temp_directory_path() / ("nibble_cli_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(tmp_);
    fs::create_directories(tmp_);
  }
  void TearDown() override { fs::remove_all(tmp_); }

  // A writable copy of a fixture model.
  std::string copy_model(const std::string& name) {
    fs::path dst = tmp_ / (name + "-" + std::to_string(n_copies_++));
    fs::copy(fixture(name), dst, fs::copy_options::recursive);
    for (auto& e : fs::directory_iterator(dst)) fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
    return dst.string();
  }
  void edit_config(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
    edit(j);
    std::ofstream(dir + "/config.json") << j.dump(2);
  }
  // Rewrites model.safetensors with `edit` applied to the tensor list.
  // Tensors the edit adds replace the originals of the same name.
  void rewrite_weights(const std::string& dir, const std::function<void(SafetensorsWriter&)>& edit) {
    const std::string path = dir + "/model.safetensors";
    fs::rename(path, path + ".orig");
    {
      auto src = SafetensorsFile::open(path + ".orig");
      SafetensorsWriter w;
      edit(w);
      for (auto& [name, t] : src->tensors()) {
        if (edited_.count(name)) continue;
        const TensorInfo* info = &t;
        w.add(name, t.dtype, t.shape, [info] { return std::vector<uint8_t>(info->data, info->data + info->nbytes); });
      }
      w.write(path, {});
    }
    fs::remove(path + ".orig");
  }
  void expect_error(const Result& r, std::initializer_list<std::string> parts) {
    EXPECT_FALSE(r.crashed) << r.output;
    EXPECT_NE(r.exit_code, 0) << r.output;
    for (auto& p : parts) EXPECT_NE(r.output.find(p), std::string::npos) << "missing '" << p << "' in:\n" << r.output;
  }
  fs::path tmp_;
  std::set<std::string> edited_;
  int n_copies_ = 0;
};

TEST_F(CliTest, RunGreedyJsonLogprobsMatchesFixture) {
  // The fixture's greedy continuation (from transformers) through the CLI, with logprobs.
  auto expected = SafetensorsFile::open(fixture("tiny-qwen3-moe") + "/expected.safetensors");
  const TensorInfo& p = expected->tensors().at("prompt_ids");
  const TensorInfo& g = expected->tensors().at("greedy_ids");
  std::string ids;
  for (int64_t i = 0; i < p.numel(); ++i) ids += (i ? "," : "") + std::to_string(reinterpret_cast<const int32_t*>(p.data)[i]);
  Result r = run_nibble("run -m " + fixture("tiny-qwen3-moe") + " --prompt-ids " + ids +
                        " -n 8 --temperature 0 --ignore-eos --logprobs 3 --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::istringstream lines(r.output);
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] != '{') continue;
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["id"].get<int32_t>(), reinterpret_cast<const int32_t*>(g.data)[n]) << "token " << n;
    ASSERT_EQ(j["top_logprobs"].size(), 3u);
    EXPECT_EQ(j["top_logprobs"][0]["id"], j["id"]);  // greedy picks the top logprob
    EXPECT_LE(j["logprob"].get<float>(), 0.f);
    EXPECT_GE(j["top_logprobs"][0]["logprob"].get<float>(), j["top_logprobs"][1]["logprob"].get<float>());
    ++n;
  }
  EXPECT_EQ(n, 8);
  EXPECT_NE(r.output.find("generated: 8 tokens"), std::string::npos) << r.output;
}

TEST_F(CliTest, RunTextPromptStreamsAndReportsSpeed) {
  Result r = run_nibble("run -m " + fixture("tiny-qwen3-moe-int4-g32") + " --prompt 'def f(x):' -n 5 --seed 7");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("prompt: "), std::string::npos);
  EXPECT_NE(r.output.find("tok/s"), std::string::npos);
  // Same seed, same output; sampling is on (temperature from generation_config.json).
  EXPECT_EQ(run_nibble("run -m " + fixture("tiny-qwen3-moe-int4-g32") + " --prompt 'def f(x):' -n 5 --seed 7").output
                .substr(0, 20), r.output.substr(0, 20));
}

TEST_F(CliTest, InfoReportsParametersAndBytes) {
  Result r = run_nibble("info --json -m " + fixture("tiny-qwen3-moe"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  // By hand from the config: 400x96 embed + lm_head, per layer attention 96x160 q/o, 96x80 k/v,
  // norms; layers 0 and 2 have 7 experts of 3x96x48 plus a 7x96 router, layer 1 a 3x96x160 MLP.
  const int64_t attn = 2 * 96 * 160 + 2 * 96 * 80 + 2 * 40 + 2 * 96;
  const int64_t expert = 3 * 96 * 48;
  const int64_t total = 2 * 400 * 96 + 96 + 3 * attn + 2 * (7 * expert + 7 * 96) + 3 * 96 * 160;
  EXPECT_EQ(j["params_total"].get<int64_t>(), total);
  EXPECT_EQ(j["params_active_per_token"].get<int64_t>(), total - 2 * 4 * expert);
  EXPECT_EQ(j["kv_bytes_per_token_bf16"].get<int64_t>(), 2 * 3 * 2 * 40 * 2);
  // bf16: everything but the inactive experts and all but one embedding row.
  EXPECT_EQ(j["weight_bytes_per_token"].get<int64_t>(), 2 * (total - 2 * 4 * expert - 399 * 96));
}

TEST_F(CliTest, InfoCountsMxfp4ExpertsAndSlidingLayers) {
  Result r = run_nibble("info --json -m " + fixture("tiny-gpt-oss-mxfp4"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  // 3 layers of 5 experts: gate_up 128x96 and down 96x64, two weights a byte in the blocks.
  const int64_t experts = 3 * 5 * (128 * 96 + 96 * 64);
  EXPECT_EQ(j["formats"]["MXFP4 (e2m1, e8m0/32)"]["params"].get<int64_t>(), experts);
  EXPECT_EQ(j["formats"]["MXFP4 (e2m1, e8m0/32)"]["bytes"].get<int64_t>(), experts / 2 + experts / 32);
  EXPECT_EQ(j["formats"]["MXFP4 (e2m1, e8m0/32)"]["tensors"].get<int64_t>(), 6);  // blocks; scales belong to them
  EXPECT_EQ(j["sliding_window_layers"].get<int64_t>(), 2);
  EXPECT_EQ(j["sliding_window"].get<int64_t>(), 5);
}

// `nibble run --chat` with gpt-oss's harmony template: the prompt renders, generation runs, the
// output goes through the harmony parser (the tiny model's random text is plain content).
TEST_F(CliTest, RunChatWithHarmonyTemplate) {
  const fs::path dir = tmp_ / "gpt-oss";
  fs::create_directories(dir);
  for (auto& f : fs::directory_iterator(fixture("tiny-gpt-oss-mxfp4"))) fs::copy_file(f.path(), dir / f.path().filename());
  fs::copy_file(std::string(NIBBLE_FIXTURES_DIR) + "/chat_templates/gpt-oss.jinja", dir / "chat_template.jinja");
  Result r = run_nibble("run -m " + dir.string() + " --chat 'What is 2+2?' -n 6 --temperature 0 --max-model-len 512 "
                        "--chat-template-kwargs '{\"reasoning_effort\": \"high\"}'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("generated: 6 tokens"), std::string::npos) << r.output;
}

TEST_F(CliTest, QuantizeIsDeterministicAndMatchesCommittedFixture) {
  const std::string out = (tmp_ / "q").string();
  Result r = run_nibble("quantize -m " + fixture("tiny-qwen3-moe") + " -o " + out + " --group-size 32");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream a(out + "/model.safetensors", std::ios::binary), b(fixture("tiny-qwen3-moe-int4-g32") + "/model.safetensors", std::ios::binary);
  std::string sa((std::istreambuf_iterator<char>(a)), {}), sb((std::istreambuf_iterator<char>(b)), {});
  EXPECT_TRUE(sa == sb) << "nibble quantize no longer reproduces the committed INT4 fixture; regenerate it "
                           "and its transformers reference (tools/make_fixtures.py int4-reference)";
  auto cfg = nlohmann::json::parse(std::ifstream(out + "/config.json"));
  EXPECT_EQ(cfg["quantization_config"]["quant_method"], "gptq");
  EXPECT_EQ(cfg["quantization_config"]["group_size"], 32);
  EXPECT_TRUE(fs::exists(out + "/tokenizer.json"));
  expect_error(run_nibble("quantize -m " + out + " -o " + (tmp_ / "q2").string()), {"already quantized"});
  expect_error(run_nibble("quantize -m " + fixture("tiny-qwen3") + " -o " + (tmp_ / "q3").string() + " --group-size 12"),
               {"--group-size"});
}

TEST_F(CliTest, BenchReportsTheSweepAsTableAndJson) {
  const std::string json = (tmp_ / "bench.json").string();
  Result r = run_nibble("bench -m " + fixture("tiny-qwen3-moe-int4-g32") + " -p 8,16 -n 4 -d 0,20 -r 2 --json " + json);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("| tg4 | 20 |"), std::string::npos) << r.output;
  auto j = nlohmann::json::parse(std::ifstream(json));
  ASSERT_EQ(j["results"].size(), 6u);  // (pp8, pp16, tg4) x 2 depths
  for (auto& row : j["results"]) EXPECT_GT(row["tok_s"].get<double>(), 0);
  EXPECT_GT(j["meta"]["weight_bytes_per_token"].get<double>(), 0);
  EXPECT_GT(j["meta"]["copy_bandwidth_bytes_per_s"].get<double>(), 0);
  EXPECT_FALSE(j["meta"]["commit"].get<std::string>().empty());
  EXPECT_EQ(j["meta"]["kv_cache_dtype"], "F16");
  // An f32 cache: twice the KV bytes per context token.
  const std::string json32 = (tmp_ / "bench32.json").string();
  r = run_nibble("bench -m " + fixture("tiny-qwen3-moe-int4-g32") + " -p 8 -n 2 -r 1 --kv-cache-dtype float32 --json " +
                 json32);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j32 = nlohmann::json::parse(std::ifstream(json32));
  EXPECT_EQ(j32["meta"]["kv_cache_dtype"], "F32");
  EXPECT_EQ(j32["meta"]["kv_bytes_per_context_token"].get<int64_t>(),
            2 * j["meta"]["kv_bytes_per_context_token"].get<int64_t>());
  // Decode drawn with temperature and top-p instead of greedy.
  r = run_nibble("bench -m " + fixture("tiny-qwen3-moe-int4-g32") + " -p 8 -n 4 -r 1 --temperature 0.7 --top-p 0.9 --json " +
                 json32);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FLOAT_EQ(nlohmann::json::parse(std::ifstream(json32))["meta"]["temperature"].get<float>(), 0.7f);
  expect_error(run_nibble("bench -m " + fixture("tiny-qwen3") + " --temperature -1"), {"--temperature"});
  expect_error(run_nibble("bench -m " + fixture("tiny-qwen3") + " --kv-cache-dtype int8"), {"--kv-cache-dtype", "int8"});
  expect_error(run_nibble("run -m " + fixture("tiny-qwen3") + " --prompt hi --kv-cache-dtype f8"), {"--kv-cache-dtype"});
  expect_error(run_nibble("bench -m " + fixture("tiny-qwen3") + " -p 8,x"), {"-p", "'x'"});
  expect_error(run_nibble("bench -m " + fixture("tiny-qwen3") + " --load-format dummy --quantization int3"),
               {"--quantization int3"});
}

TEST_F(CliTest, MissingFiles) {
  expect_error(run_nibble("run -m " + (tmp_ / "nope").string() + " --prompt hi"), {"nope"});
  fs::create_directories(tmp_ / "empty");
  expect_error(run_nibble("run -m " + (tmp_ / "empty").string() + " --prompt hi"), {"config.json", "missing"});
  std::string dir = copy_model("tiny-qwen3");
  fs::remove(dir + "/model.safetensors");
  expect_error(run_nibble("run -m " + dir + " --prompt hi"), {"no model.safetensors"});
  dir = copy_model("tiny-qwen3-moe");
  fs::remove(dir + "/tokenizer.json");
  expect_error(run_nibble("run -m " + dir + " --prompt hi"), {"tokenizer.json", "missing"});
}

TEST_F(CliTest, TruncatedCheckpoint) {
  std::string dir = copy_model("tiny-qwen3-moe");
  fs::resize_file(dir + "/model.safetensors", fs::file_size(dir + "/model.safetensors") / 2);
  expect_error(run_nibble("run -m " + dir + " --prompt hi"), {"model.safetensors", "truncated"});
  fs::resize_file(dir + "/model.safetensors", 5);
  expect_error(run_nibble("info -m " + dir), {"model.safetensors", "too short"});
}

TEST_F(CliTest, ShardIndexNamingAMissingShard) {
  std::string dir = copy_model("tiny-qwen3");
  std::ofstream(dir + "/model.safetensors.index.json")
      << R"({"metadata":{},"weight_map":{"model.norm.weight":"model-00002-of-00002.safetensors"}})";
  expect_error(run_nibble("info -m " + dir), {"model-00002-of-00002.safetensors", "missing"});
}

TEST_F(CliTest, ShapeOrDtypeDisagreesWithConfig) {
  std::string dir = copy_model("tiny-qwen3-moe");
  edit_config(dir, [](auto& j) { j["moe_intermediate_size"] = 56; });
  expect_error(run_nibble("run -m " + dir + " --prompt hi"),
               {"model.safetensors", "model.layers.0.mlp.experts.0.gate_proj.weight", "[48, 96]", "[56, 96]"});

  dir = copy_model("tiny-qwen3");
  edited_ = {"model.norm.weight"};
  rewrite_weights(dir, [](SafetensorsWriter& w) {
    w.add("model.norm.weight", DType::I32, {80}, [] { return std::vector<uint8_t>(320, 1); });
  });
  expect_error(run_nibble("run -m " + dir + " --prompt hi"), {"model.norm.weight", "I32"});

  dir = copy_model("tiny-qwen3-moe-int4-g32");
  edited_ = {"model.layers.0.self_attn.q_proj.scales"};
  rewrite_weights(dir, [](SafetensorsWriter& w) {
    w.add("model.layers.0.self_attn.q_proj.scales", DType::F16, {2, 160}, [] { return std::vector<uint8_t>(640, 60); });
  });
  expect_error(run_nibble("run -m " + dir + " --prompt hi"), {"model.layers.0.self_attn.q_proj.scales", "[2, 160]", "[3, 160]"});
}

TEST_F(CliTest, OverlappingTensors) {
  std::string dir = copy_model("tiny-qwen3");
  std::string header = R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})";
  std::ofstream f(dir + "/model.safetensors", std::ios::binary | std::ios::trunc);
  uint64_t n = header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header << std::string(24, '\x01');
  f.close();
  expect_error(run_nibble("info -m " + dir), {"model.safetensors", "'a'", "'b'", "overlap"});
}

TEST_F(CliTest, UnsupportedArchitectureAndQuantization) {
  std::string dir = copy_model("tiny-qwen3");
  edit_config(dir, [](auto& j) { j["model_type"] = "llama4"; });
  expect_error(run_nibble("run -m " + dir + " --prompt hi"), {"config.json", "model_type 'llama4'", "qwen3_moe"});
  dir = copy_model("tiny-qwen3-moe-int4-g32");
  edit_config(dir, [](auto& j) { j["quantization_config"]["quant_method"] = "awq"; });
  expect_error(run_nibble("run -m " + dir + " --prompt hi"), {"config.json", "quant_method 'awq'"});
  dir = copy_model("tiny-qwen3-moe-int4-g32");
  edit_config(dir, [](auto& j) { j.erase("quantization_config"); });
  expect_error(run_nibble("run -m " + dir + " --prompt hi"), {"qweight", "quantization_config"});
  dir = copy_model("tiny-qwen3");
  std::ofstream(dir + "/config.json") << "{ not json";
  expect_error(run_nibble("info -m " + dir), {"config.json", "not valid JSON"});
}

TEST_F(CliTest, BadPrompts) {
  const std::string m = fixture("tiny-qwen3");
  expect_error(run_nibble("run -m " + m + " --prompt-ids 1,x,3"), {"--prompt-ids", "'x'"});
  expect_error(run_nibble("run -m " + m + " --prompt-ids 1,100000"), {"100000", "vocabulary"});
  expect_error(run_nibble("run -m " + m + " --prompt 'a b c d e f g h i j k' --max-model-len 4"), {"context"});
  expect_error(run_nibble("run -m " + m + " --prompt hi --prompt-ids 1"), {"exactly one"});
  expect_error(run_nibble("run -m " + m + " --prompt hi --temperature -1"), {"temperature"});
  expect_error(run_nibble("run -m " + m + " --prompt hi --device tpu"), {"--device tpu"});
  // Chat prompts: a model without a chat template, bad kwargs, --system alone.
  expect_error(run_nibble("run -m " + m + " --chat hi"), {"no chat template"});
  const std::string tiny = std::string(NIBBLE_MODELS_DIR) + "/nibble-tiny-coder";
  expect_error(run_nibble("run -m " + tiny + " --chat hi --chat-template-kwargs '[1]'"), {"--chat-template-kwargs", "object"});
  expect_error(run_nibble("run -m " + tiny + " --system hi --prompt x"), {"--system needs --chat"});
  expect_error(run_nibble("run -m " + tiny + " --chat hi --prompt x"), {"exactly one"});
}

// nibble serve refuses bad arguments with a message, before it would block serving.
TEST_F(CliTest, ServeBadArguments) {
  const std::string tiny = std::string(NIBBLE_MODELS_DIR) + "/nibble-tiny-coder";
  expect_error(run_nibble("serve"), {"needs a model directory"});
  expect_error(run_nibble("serve " + tiny + " --port 70000"), {"--port 70000"});
  expect_error(run_nibble("serve " + tiny + " --host no.such.host.invalid --port 0"), {"--host no.such.host.invalid"});
  expect_error(run_nibble("serve " + tiny + " --reasoning-parser magic --port 0"), {"--reasoning-parser magic"});
  expect_error(run_nibble("serve " + fixture("tiny-qwen3") + " --model " + tiny), {"give the model once"});
  expect_error(run_nibble("serve " + tiny + " --device tpu"), {"--device tpu"});
}

// --chat renders the bundled model's ChatML template (default system prompt, generation prompt):
// the same ids as that text tokenized and given as --prompt-ids.
TEST_F(CliTest, RunChatUsesTheModelsTemplate) {
  const std::string tiny = std::string(NIBBLE_MODELS_DIR) + "/nibble-tiny-coder";
  const std::string flags = " -n 12 --temperature 0 --json";
  auto ids_of = [&](const std::string& text) {
    std::string out;
    for (int32_t id : Tokenizer::from_file(tiny + "/tokenizer.json").encode(text)) {
      if (!out.empty()) out += ',';
      out += std::to_string(id);
    }
    return out;
  };
  for (const std::string system : {"", "Be brief."}) {
    const std::string chatml = "<|im_start|>system\n" + (system.empty() ? "You are a helpful coding assistant." : system) +
                               "<|im_end|>\n<|im_start|>user\nReverse a string.<|im_end|>\n<|im_start|>assistant\n";
    Result chat = run_nibble("run -m " + tiny + (system.empty() ? "" : " --system '" + system + "'") +
                             " --chat 'Reverse a string.'" + flags);
    ASSERT_EQ(chat.exit_code, 0) << chat.output;
    Result raw = run_nibble("run -m " + tiny + " --prompt-ids " + ids_of(chatml) + flags);
    ASSERT_EQ(raw.exit_code, 0) << raw.output;
    auto body = [](const std::string& s) { return s.substr(0, s.find("prompt: ")); };  // not the timings
    EXPECT_EQ(body(chat.output), body(raw.output)) << "system '" << system << "'";
    EXPECT_FALSE(body(chat.output).empty());
  }
}

}  // namespace
}  // namespace nibble
