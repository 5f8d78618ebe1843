#include "backend/cuda/kernel_trace.h"

#include <cupti_activity.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

namespace nibble::cuda {
namespace {

// The few CUPTI entry points the trace needs, resolved from the shared library.
struct Cupti {
  void* handle = nullptr;
  CUptiResult (*enable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*disable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc) = nullptr;
  CUptiResult (*flush_all)(uint32_t) = nullptr;
  CUptiResult (*next_record)(uint8_t*, size_t, CUpti_Activity**) = nullptr;
};

Cupti* load_cupti(std::string* why_not) {
  static Cupti cupti;
  static std::string error;
  static std::once_flag once;
  std::call_once(once, [] {
    std::vector<std::string> names = {"libcupti.so", "libcupti.so.13", "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so",
                                      "/usr/local/cuda/lib64/libcupti.so"};
    if (const char* path = std::getenv("NIBBLE_CUPTI")) names.insert(names.begin(), path);
    for (const std::string& name : names)
      if ((cupti.handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL))) break;
    if (!cupti.handle) {
      error = "libcupti.so was not found (set NIBBLE_CUPTI to its path)";
      return;
    }
    auto sym = [&](auto& fn, const char* name) { fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(cupti.handle, name)); };
    sym(cupti.enable, "cuptiActivityEnable");
    sym(cupti.disable, "cuptiActivityDisable");
    sym(cupti.register_callbacks, "cuptiActivityRegisterCallbacks");
    sym(cupti.flush_all, "cuptiActivityFlushAll");
    sym(cupti.next_record, "cuptiActivityGetNextRecord");
    if (!cupti.enable || !cupti.disable || !cupti.register_callbacks || !cupti.flush_all || !cupti.next_record)
      error = "libcupti.so lacks the activity API";
  });
  if (!error.empty()) {
    *why_not = error;
    return nullptr;
  }
  return &cupti;
}

std::mutex spans_mutex;
std::vector<KernelSpan> spans;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  constexpr size_t kBytes = 8 << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = kBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  Cupti* cupti = load_cupti(nullptr);
  CUpti_Activity* record = nullptr;
  std::lock_guard lock(spans_mutex);
  while (cupti && cupti->next_record(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      spans.push_back({k->name ? k->name : "?", k->start, k->end});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* c = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      spans.push_back({c->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH   ? "memcpy device to host"
                       : c->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD ? "memcpy host to device"
                                                                        : "memcpy",
                       c->start, c->end});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* c = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      spans.push_back({"memset", c->start, c->end});
    }
  }
  std::free(buffer);
}

}  // namespace

bool kernel_trace_start(std::string* why_not) {
  Cupti* cupti = load_cupti(why_not);
  if (!cupti) return false;
  {
    std::lock_guard lock(spans_mutex);
    spans.clear();
  }
  if (cupti->register_callbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
      cupti->enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS ||
      cupti->enable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS ||
      cupti->enable(CUPTI_ACTIVITY_KIND_MEMSET) != CUPTI_SUCCESS) {
    *why_not = "CUPTI refused to start the activity trace";
    return false;
  }
  return true;
}

std::vector<KernelSpan> kernel_trace_stop() {
  std::string unused;
  Cupti* cupti = load_cupti(&unused);
  if (!cupti) return {};
  cupti->flush_all(1);  // CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
  cupti->disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cupti->disable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cupti->disable(CUPTI_ACTIVITY_KIND_MEMSET);
  cupti->flush_all(1);
  std::lock_guard lock(spans_mutex);
  std::vector<KernelSpan> out = std::move(spans);
  spans.clear();
  std::sort(out.begin(), out.end(), [](const KernelSpan& a, const KernelSpan& b) { return a.start_ns < b.start_ns; });
  return out;
}

}  // namespace nibble::cuda
