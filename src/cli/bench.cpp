// nibble bench: the prefill-vs-decode sweep (bench/sweep.h) on one model and device, printed as a
// Markdown table with the roofline beside each decode figure, and written as JSON with the run's
// metadata (commit, device, driver, flags) for BENCHMARKS.md.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bench/batch_decode.h"
#include "bench/sweep.h"
#include "core/version.h"
#include "cli/commands.h"
#include "core/status.h"

namespace nibble::cli {
namespace {

struct BenchOptions {
  std::string model_dir, device = "cpu", load_format = "auto", quantization, json_path, prompts = "512",
              depths = "0", kv_cache_dtype = "auto", batches,
              quantize_layers, quantize_format = "int4";
  int64_t generate = 128;
  int repetitions = 3;
  bool enforce_eager = false, profile = false;
  float temperature = 0, top_p = 1;
  int32_t top_k = 0;
  std::vector<std::string> argv;
};

std::vector<int64_t> parse_list(const std::string& text, const char* flag) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
    }
    NIBBLE_CHECK(used == item.size() && v >= 0, "{} {}: '{}' is not a non-negative integer", flag, text, item);
    out.push_back(v);
  }
  NIBBLE_CHECK(!out.empty(), "{}: empty list", flag);
  return out;
}

void bench(const BenchOptions& o) {
  SweepOptions sweep;
  sweep.prompt_tokens = parse_list(o.prompts, "-p");
  sweep.depths = parse_list(o.depths, "-d");
  sweep.generate_tokens = o.generate;
  sweep.repetitions = o.repetitions;
  sweep.profile_steps = o.profile ? 16 : 0;
  sweep.sampling.temperature = o.temperature;
  sweep.sampling.top_p = o.top_p;
  sweep.sampling.top_k = o.top_k;
  NIBBLE_CHECK(std::isfinite(o.temperature) && o.temperature >= 0, "--temperature must be >= 0, got {}", o.temperature);
  NIBBLE_CHECK(o.top_p > 0 && o.top_p <= 1, "--top-p must be in (0, 1], got {}", o.top_p);
  for (int64_t p : sweep.prompt_tokens) NIBBLE_CHECK(p > 0, "-p: prompt sizes must be positive");
  auto backend = make_backend(o.device);
  LoadOptions load;
  load.load_format = o.load_format;
  load.quantization = o.quantization;
  load.enforce_eager = o.enforce_eager;
  load.kv_cache_dtype = parse_kv_cache_dtype(o.kv_cache_dtype);
  load.quantize_layers = parse_quantize_layers(o.quantize_layers);
  load.quantize_format = o.quantize_format;
  const auto t0 = std::chrono::steady_clock::now();
  auto model = load_model(o.model_dir, *backend, load);
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double bandwidth = backend->copy_bandwidth();
  const auto results = run_sweep(*model, sweep, bandwidth);

  const ModelConfig& c = model->config();
  const std::string device = backend->description();
  const double weight_bytes = double(model->weight_bytes_per_token());
  fmt::print("nibble bench — {} ({}{}{}), {}\n", o.model_dir, c.model_type,
             o.load_format == "dummy" ? ", dummy weights" + (o.quantization.empty() ? std::string() : " " + o.quantization)
                                      : std::string(),
             o.quantize_layers.empty() ? std::string()
                                       : fmt::format(", {} at load: {}", o.quantize_format, o.quantize_layers), device);
  fmt::print("weights read per decoded token {:.3f} GB; KV cache {}, {:.1f} KB per context token; copy bandwidth "
             "{:.2f} TB/s; roofline at depth 0 {:.0f} tok/s\n\n", weight_bytes / 1e9, dtype_name(model->kv_dtype()),
             double(model->kv_bytes_per_context_token()) / 1e3, bandwidth / 1e12, bandwidth / weight_bytes);
  fmt::print("| test | depth | tok/s | TTFT ms | GB/s | % roofline |\n|---|---:|---:|---:|---:|---:|\n");
  for (auto& r : results) {
    if (r.test[0] == 'p')
      fmt::print("| {} | {} | {:.1f} ± {:.1f} | {:.1f} | | |\n", r.test, r.depth, r.tok_s_mean, r.tok_s_std, r.ttft_ms_mean);
    else
      fmt::print("| {} | {} | {:.1f} ± {:.1f} | | {:.0f} | {:.1f}% |\n", r.test, r.depth, r.tok_s_mean, r.tok_s_std,
                 r.gb_s, r.roofline_pct);
  }
  std::vector<BatchDecodeResult> batched;
  if (!o.batches.empty()) {
    fmt::print("\n| batch | depth | step ms | aggregate tok/s |\n|---:|---:|---:|---:|\n");
    for (int64_t d : sweep.depths)
      for (const BatchDecodeResult& b :
           run_batch_decode(*model, parse_list(o.batches, "--batch"), d, std::max<int64_t>(o.generate, 8), o.repetitions,
                            sweep.seed, sweep.profile_steps)) {
        fmt::print("| {} | {} | {:.2f} | {:.1f} ± {:.1f} |\n", b.batch, b.depth, b.step_ms, b.tok_s, b.tok_s_std);
        std::fflush(stdout);
        batched.push_back(b);
      }
  }
  for (auto& r : results) {
    if (!o.profile) continue;
    const std::string what = r.test[0] == 't' ? "Decode step" : fmt::format("Prefill of {} tokens", r.test.substr(2));
    if (r.profile.steps == 0)
      fmt::print("\nno profile ({}) at depth {}: {}\n", what, r.depth, r.profile_error);
    else
      fmt::print("\n### {} at depth {}\n\n{}", what, r.depth, format_profile(r.profile));
  }
  for (auto& b : batched) {
    if (!o.profile) continue;
    if (b.profile.steps == 0)
      fmt::print("\nno profile of batch {} at depth {}: {}\n", b.batch, b.depth, b.profile_error);
    else
      fmt::print("\n### Batched decode step, batch {} at depth {}\n\n{}", b.batch, b.depth, format_profile(b.profile));
  }
  if (!o.json_path.empty()) {
    const std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    nlohmann::json j;
    j["meta"] = {{"nibble", NIBBLE_VERSION}, {"commit", git_commit()}, {"date", date}, {"device", device},
                 {"model", o.model_dir}, {"model_type", c.model_type}, {"load_format", o.load_format},
                 {"quantization", o.quantization}, {"quantize_layers", o.quantize_layers}, {"quantize_format", o.quantize_format}, {"enforce_eager", o.enforce_eager},
                 {"kv_cache_dtype", dtype_name(model->kv_dtype())}, {"temperature", o.temperature},
                 {"top_p", o.top_p}, {"top_k", o.top_k}, {"load_seconds", load_s},
                 {"copy_bandwidth_bytes_per_s", bandwidth}, {"weight_bytes_per_token", weight_bytes},
                 {"kv_bytes_per_context_token", model->kv_bytes_per_context_token()},
                 {"repetitions", o.repetitions}, {"command", o.argv}};
    for (auto& r : results)
      j["results"].push_back({{"test", r.test}, {"depth", r.depth}, {"tok_s", r.tok_s_mean}, {"tok_s_std", r.tok_s_std},
                              {"ttft_ms", r.ttft_ms_mean}, {"bytes_per_token", r.bytes_per_token},
                              {"gb_s", r.gb_s}, {"roofline_pct", r.roofline_pct}});
    for (auto& b : batched) {
      nlohmann::json row = {{"batch", b.batch}, {"depth", b.depth}, {"step_ms", b.step_ms}, {"tok_s", b.tok_s},
                            {"tok_s_std", b.tok_s_std}};
      for (const ProfileRow& k : b.profile.kernels)
        row["profile"].push_back({{"kernel", k.name}, {"category", k.category}, {"calls_per_step", k.calls_per_step},
                                  {"us_per_step", k.us_per_step}});
      j["batched"].push_back(row);
    }
    for (auto& r : results)
      for (const ProfileRow& row : r.profile.kernels)
        j["profile"].push_back({{"test", r.test}, {"depth", r.depth}, {"kernel", row.name}, {"category", row.category},
                                {"calls_per_step", row.calls_per_step}, {"us_per_step", row.us_per_step}});
    std::ofstream(o.json_path) << j.dump(2) << '\n';
  }
}

}  // namespace

void add_bench_command(CLI::App& app, int argc, char** argv) {
  auto o = std::make_shared<BenchOptions>();
  o->argv.assign(argv, argv + argc);
  CLI::App* cmd = app.add_subcommand("bench", "Prefill/decode throughput sweep with the roofline");
  cmd->add_option("-m,--model", o->model_dir, "Model directory (config.json is enough with dummy weights)")
      ->required()->check(CLI::ExistingDirectory);
  cmd->add_option("--device", o->device, "cpu or cuda");
  cmd->add_option("--load-format", o->load_format, "auto (the checkpoint) or dummy (random weights)");
  cmd->add_option("--quantization", o->quantization, "With dummy weights: int4 (W4A16, group 128), or mxfp4 (gpt-oss's experts as shipped)");
  cmd->add_option("-p,--n-prompt", o->prompts, "Prompt sizes to prefill, comma-separated");
  cmd->add_option("-n,--n-gen", o->generate, "Tokens to decode (0: no decode test)")->check(CLI::NonNegativeNumber);
  cmd->add_option("-d,--depth", o->depths, "Context depths, comma-separated");
  cmd->add_option("-r,--repetitions", o->repetitions, "Repetitions (mean ± std)")->check(CLI::PositiveNumber);
  cmd->add_option("--json", o->json_path, "Also write the results as JSON to this file");
  cmd->add_flag("--enforce-eager", o->enforce_eager, "Launch every op as it comes (no recorded graphs)");
  cmd->add_option("--kv-cache-dtype", o->kv_cache_dtype, "KV cache element type: auto (float16), float32 or fp8 (E4M3, half the bytes of float16)");
  cmd->add_option("--quantize-layers", o->quantize_layers,
                  "Quantize these 16-bit layers to 4 bits at load: a list of lm_head, qkv, o, router (see --quantize-format)");
  cmd->add_option("--quantize-format", o->quantize_format,
                  "Format of --quantize-layers: int4 (group 128, the default) or mxfp4 (blocks of 32, gpt-oss's)");
  cmd->add_option("--temperature", o->temperature, "Decode sampling temperature (0: greedy, the default)");
  cmd->add_option("--top-p", o->top_p, "Decode nucleus mass, with --temperature");
  cmd->add_option("--top-k", o->top_k, "Decode top-k, with --temperature (0: off)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--batch", o->batches,
                  "Also decode batches of these many sequences at each depth (e.g. 1,8,32,64): aggregate tok/s of "
                  "the engine's batched steps");
  cmd->add_flag("--profile", o->profile,
                "After each decode test, trace 16 more steps on the device and print where a step's time goes; "
                "after each prefill test, the same for one more prefill");
  cmd->callback([o] { bench(*o); });
}

}  // namespace nibble::cli
