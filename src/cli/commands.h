// Subcommands of the nibble binary; each file registers its own options and action.
#pragma once

#include <CLI/CLI.hpp>

namespace nibble::cli {

void add_run_command(CLI::App& app);
void add_info_command(CLI::App& app);
void add_quantize_command(CLI::App& app);
void add_serve_command(CLI::App& app);
void add_bench_command(CLI::App& app, int argc, char** argv);
void add_bench_serve_command(CLI::App& app);

}  // namespace nibble::cli
