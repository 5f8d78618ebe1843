// nibble: one binary for run | serve | info | quantize | bench.
#include <fmt/format.h>

#include "cli/commands.h"
#include "core/status.h"
#include "core/version.h"

int main(int argc, char** argv) {
  CLI::App app{"nibble: a native inference engine for 4-bit Mixture-of-Experts language models"};
  app.set_version_flag("--version", fmt::format("{} ({})", NIBBLE_VERSION, nibble::git_commit()));
  app.require_subcommand(1);
  nibble::cli::add_run_command(app);
  nibble::cli::add_serve_command(app);
  nibble::cli::add_info_command(app);
  nibble::cli::add_quantize_command(app);
  nibble::cli::add_bench_command(app, argc, argv);
  nibble::cli::add_bench_serve_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const nibble::Error& e) {
    fmt::print(stderr, "nibble: error: {}\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "nibble: error: out of memory\n");
    return 1;
  }
  return 0;
}
