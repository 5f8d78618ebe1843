#include "backend/backend.h"

#include "core/status.h"

namespace nibble {

#ifdef NIBBLE_HAVE_CUDA
std::unique_ptr<Backend> make_cuda_backend();
#endif

std::unique_ptr<Backend> make_backend(const std::string& device) {
  if (device == "cpu") return make_cpu_backend();
  if (device == "cuda") {
#ifdef NIBBLE_HAVE_CUDA
    return make_cuda_backend();
#else
    fail("--device cuda: this nibble was built without CUDA (configure with the cuda preset, "
         "NIBBLE_CUDA=ON)");
#endif
  }
  fail("--device {}: unknown device (cpu, cuda)", device);
}

}  // namespace nibble
