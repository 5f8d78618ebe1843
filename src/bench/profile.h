// `nibble bench --profile`: where a decode step's GPU time goes, from a device trace of a few
// consecutive decode steps (Backend::start_trace). Kernels overlap under programmatic dependent
// launch, so time is attributed along the critical path: a kernel is charged from the later of
// its start and the previous end to its own end, and time when nothing runs is a gap (short gaps
// inside a step are launch/dependency latency; long ones are the host between steps).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace nibble {

struct ProfileRow {
  std::string name;
  std::string category;
  double calls_per_step = 0;
  double us_per_step = 0;
};

struct StepProfile {
  int64_t steps = 0;
  double step_us = 0;  // trace span / steps
  std::vector<ProfileRow> kernels;     // by kernel, most time first
  std::vector<ProfileRow> categories;  // by category, most time first
};

// "nibble::kernels::gemv_int4_kernel<...>" from its mangled symbol; the input when not mangled.
std::string kernel_base_name(const std::string& symbol);
std::string kernel_category(const std::string& base_name);
StepProfile profile_steps(const std::vector<KernelSpan>& spans, int64_t steps);
// The two tables as Markdown.
std::string format_profile(const StepProfile& p);

}  // namespace nibble
