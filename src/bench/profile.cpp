#include "bench/profile.h"

#include <algorithm>
#include <cctype>
#include <map>

#include <fmt/format.h>

namespace nibble {

// Gaps longer than this are the host between steps (sampling, input copies, the graph launch);
// shorter ones are the latency between dependent kernels inside a step.
constexpr uint64_t kHostGapNs = 8000;

std::string kernel_base_name(const std::string& symbol) {
  // Itanium mangling: _ZN <len><name> <len><name> ... ; take the last name of the nested prefix.
  if (symbol.rfind("_ZN", 0) != 0) return symbol;
  size_t i = 3;
  std::string last;
  while (i < symbol.size() && std::isdigit(static_cast<unsigned char>(symbol[i]))) {
    size_t len = 0;
    while (i < symbol.size() && std::isdigit(static_cast<unsigned char>(symbol[i]))) len = len * 10 + size_t(symbol[i++] - '0');
    if (i + len > symbol.size()) break;
    last = symbol.substr(i, len);
    i += len;
  }
  return last.empty() ? symbol : last;
}

std::string kernel_category(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("memcpy") || has("memset")) return "copies (logits out, inputs in)";
  if (has("moe_mxfp4") || has("gemm_mxfp4_moe")) return "experts (MXFP4)";
  if (has("moe_gate_up") || has("moe_down") || has("grouped")) return "experts (INT4)";
  if (has("moe_group") || has("moe_combine") || has("gather_rows") || has("scatter_add")) return "expert grouping + combine";
  if (has("mxfp4_dequant")) return "MXFP4 -> BF16 dequantisation";
  if (has("gemv_mxfp4") || has("gemm_mxfp4")) return "projections (MXFP4)";
  if (has("moe_router") || has("moe_route")) return "router + routing";
  if (has("gemv_int4") || has("gemm_int4")) return "attention projections (INT4)";
  if (has("gemv_dense") || has("gemv_bf16") || has("gemm_dense") || has("linear_dense") || has("split_16bit")) return "lm_head / dense";
  if (has("nvjet") || has("xmma") || has("cutlass") || has("gemmSN")) return "dense GEMM (cuBLASLt)";
  if (has("attention")) return "attention";
  if (has("qk_norm_rope")) return "q/k norm + RoPE + KV write";
  if (has("norm") || has("embed") || has("add_kernel") || has("silu")) return "norms, embedding, elementwise";
  if (has("sample") || has("argmax") || has("RadixSort")) return "sampling";
  return "other";
}

StepProfile profile_steps(const std::vector<KernelSpan>& spans, int64_t steps) {
  StepProfile p;
  p.steps = steps;
  if (spans.empty() || steps <= 0) return p;
  std::map<std::string, ProfileRow> kernels;
  double launch_gaps = 0, host_gaps = 0;
  uint64_t prev_end = spans.front().start_ns, first = spans.front().start_ns, last = 0;
  for (const KernelSpan& s : spans) {
    if (s.start_ns > prev_end) (s.start_ns - prev_end > kHostGapNs ? host_gaps : launch_gaps) += double(s.start_ns - prev_end);
    const uint64_t from = std::max(s.start_ns, prev_end);
    ProfileRow& row = kernels[kernel_base_name(s.name)];
    row.calls_per_step += 1;
    if (s.end_ns > from) row.us_per_step += double(s.end_ns - from);
    prev_end = std::max(prev_end, s.end_ns);
    last = std::max(last, s.end_ns);
  }
  p.step_us = double(last - first) / 1e3 / double(steps);
  std::map<std::string, ProfileRow> categories;
  auto add = [&](ProfileRow row) {
    row.calls_per_step /= double(steps);
    row.us_per_step /= 1e3 * double(steps);
    ProfileRow& c = categories[row.category];
    c.name = c.category = row.category;
    c.calls_per_step += row.calls_per_step;
    c.us_per_step += row.us_per_step;
    p.kernels.push_back(std::move(row));
  };
  for (auto& [name, row] : kernels) {
    row.name = name;
    row.category = kernel_category(name);
    add(row);
  }
  add({"(gaps between kernels)", "idle: gaps between kernels", 0, launch_gaps});
  add({"(host between steps)", "idle: host between steps", 0, host_gaps});
  for (auto& [name, row] : categories) p.categories.push_back(row);
  auto by_time = [](const ProfileRow& a, const ProfileRow& b) { return a.us_per_step > b.us_per_step; };
  std::sort(p.kernels.begin(), p.kernels.end(), by_time);
  std::sort(p.categories.begin(), p.categories.end(), by_time);
  return p;
}

std::string format_profile(const StepProfile& p) {
  std::string out = fmt::format("step: {:.1f} us ({} steps traced; time on the critical path, see bench/profile.h)\n\n",
                                p.step_us, p.steps);
  out += "| category | kernels/step | us/step | share |\n|---|---:|---:|---:|\n";
  for (const ProfileRow& r : p.categories)
    out += fmt::format("| {} | {:.0f} | {:.1f} | {:.1f}% |\n", r.name, r.calls_per_step, r.us_per_step,
                       100 * r.us_per_step / p.step_us);
  out += "\n| kernel | category | calls/step | us/step | us/call |\n|---|---|---:|---:|---:|\n";
  for (const ProfileRow& r : p.kernels)
    out += fmt::format("| {} | {} | {:.0f} | {:.1f} | {} |\n", r.name, r.category, r.calls_per_step, r.us_per_step,
                       r.calls_per_step > 0 ? fmt::format("{:.2f}", r.us_per_step / r.calls_per_step) : "");
  return out;
}

}  // namespace nibble
