// nibble bench-serve: load on a running server from concurrent streaming clients (bench/serve_load.h).
#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "bench/serve_load.h"
#include "cli/commands.h"
#include "core/status.h"

namespace nibble::cli {
namespace {

struct BenchServeOptions {
  ServeLoadOptions load;
  std::vector<int64_t> concurrency = {1, 8, 32, 64};
  int64_t rounds = 1;
  bool check = false;
  std::string json_path;
};

int bench_serve(const BenchServeOptions& o) {
  nlohmann::json all = nlohmann::json::array();
  fmt::print("| clients | requests | errors | prompt tok | output tok/s | req tok/s p50 | TTFT p50 / p99 ms | ITL p50 / "
             "p99 ms | server RSS MiB | KV blocks used |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  bool ok = true;
  double first_rss = -1, last_rss = -1;
  for (int64_t round = 0; round < o.rounds; ++round) {
    for (int64_t c : o.concurrency) {
      const ServeLoadLevel l = run_serve_load(o.load, c);
      fmt::print("| {} | {} | {} | {} | {:.1f} | {:.1f} | {:.1f} / {:.1f} | {:.2f} / {:.2f} | {} | {} |\n", c, l.requests,
                 l.errors, l.requests > l.errors ? l.prompt_tokens / (l.requests - l.errors) : 0, l.output_tok_s,
                 l.request_tok_s_p50, 1e3 * l.ttft_p50, 1e3 * l.ttft_p99, 1e3 * l.itl_p50, 1e3 * l.itl_p99,
                 l.server_rss_bytes >= 0 ? fmt::format("{:.0f}", l.server_rss_bytes / (1 << 20)) : "-",
                 l.kv_blocks_used >= 0 ? fmt::format("{:.0f} of {:.0f}", l.kv_blocks_used, l.kv_blocks_total) : "-");
      std::fflush(stdout);
      if (l.errors) {
        fmt::print(stderr, "bench-serve: {} of {} requests failed; the first: {}\n", l.errors, l.requests, l.first_error);
        ok = false;
      }
      if (l.kv_blocks_used > 0) {
        fmt::print(stderr, "bench-serve: {} KV blocks still in use after the level\n", l.kv_blocks_used);
        ok = false;
      }
      if (first_rss < 0) first_rss = l.server_rss_bytes;
      last_rss = l.server_rss_bytes;
      all.push_back({{"round", round}, {"concurrency", c}, {"requests", l.requests}, {"errors", l.errors},
                     {"prompt_tokens", l.prompt_tokens}, {"output_tokens", l.output_tokens}, {"seconds", l.seconds},
                     {"output_tok_s", l.output_tok_s}, {"request_tok_s_p50", l.request_tok_s_p50},
                     {"ttft_p50", l.ttft_p50}, {"ttft_p99", l.ttft_p99}, {"itl_p50", l.itl_p50}, {"itl_p99", l.itl_p99},
                     {"e2e_p50", l.e2e_p50}, {"server_rss_bytes", l.server_rss_bytes},
                     {"kv_blocks_used", l.kv_blocks_used}, {"kv_blocks_total", l.kv_blocks_total}});
    }
  }
  // A leak shows as resident memory growing from the first level to the last (allow 5% + 32 MiB
  // for allocator noise and caches that fill once).
  if (o.rounds > 1 && first_rss > 0 && last_rss > first_rss * 1.05 + 32.0 * (1 << 20)) {
    fmt::print(stderr, "bench-serve: server RSS grew from {:.0f} to {:.0f} MiB\n", first_rss / (1 << 20),
               last_rss / (1 << 20));
    ok = false;
  }
  if (!o.json_path.empty()) std::ofstream(o.json_path) << all.dump(2) << "\n";
  if (o.check && !ok) return 1;
  return 0;
}

}  // namespace

void add_bench_serve_command(CLI::App& app) {
  auto o = std::make_shared<BenchServeOptions>();
  CLI::App* cmd = app.add_subcommand(
      "bench-serve", "Load a running OpenAI-compatible server with concurrent streaming clients: output tok/s, TTFT, ITL");
  cmd->add_option("--host", o->load.host, "Server address (default 127.0.0.1)");
  cmd->add_option("--port", o->load.port, "Server port (default 8000)");
  cmd->add_option("--model", o->load.model, "Model name (default: the server's first)");
  cmd->add_option("--api-key", o->load.api_key, "Bearer token");
  cmd->add_option("-c,--concurrency", o->concurrency, "Concurrent clients, one level each (default 1,8,32,64)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  cmd->add_option("--prompt-words", o->load.prompt_words, "Random words per prompt (default 128)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-tokens", o->load.max_tokens, "Tokens per answer, exactly (ignore_eos) (default 128)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--duration", o->load.duration_s, "Seconds per level (clients keep sending until then)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--requests", o->load.requests, "Requests per level (default 2 x clients, at least 8)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--rounds", o->rounds, "Run all levels this many times (a leak check compares the rounds)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--seed", o->load.seed, "Prompt seed (default 42)");
  cmd->add_flag("--check", o->check,
                "Exit 1 on any failed request, KV blocks left in use after a level, or server RSS growth across rounds");
  cmd->add_option("--json", o->json_path, "Write the levels as JSON");
  cmd->callback([o] {
    const int rc = bench_serve(*o);
    if (rc) throw CLI::RuntimeError(rc);
  });
}

}  // namespace nibble::cli
