// Device-side timestamps of every kernel and copy the GPU runs, from CUPTI's activity API
// (graph replays included, which CUDA events cannot see into). libcupti is opened at run time
// (dlopen) only when a trace is asked for, so nibble does not depend on it otherwise.
#pragma once

#include <string>
#include <vector>

#include "backend/backend.h"

namespace nibble::cuda {

// False with the reason in *why_not when CUPTI cannot be loaded or started.
bool kernel_trace_start(std::string* why_not);
// Flushes and returns what ran since kernel_trace_start, ordered by start time.
std::vector<KernelSpan> kernel_trace_stop();

}  // namespace nibble::cuda
