// libFuzzer target: the safetensors header parser on arbitrary bytes. It must either accept the
// file, with every tensor lying inside the buffer and none overlapping, or throw nibble::Error;
// anything else (a crash, a sanitizer report, another exception) is a bug.
#include <cstdint>
#include <span>

#include "core/status.h"
#include "format/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto file = nibble::SafetensorsFile::parse(std::span<const uint8_t>(data, size), "fuzz.safetensors");
    for (auto& [name, t] : file->tensors()) {
      if (t.data < data || t.data + t.nbytes > data + size) __builtin_trap();
      if (t.nbytes != size_t(t.numel()) * nibble::dtype_size_bytes(t.dtype)) __builtin_trap();
    }
  } catch (const nibble::Error&) {
  }
  return 0;
}
