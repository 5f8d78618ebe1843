#include "backend/cuda/cublaslt.h"

#include <cublasLt.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "backend/cuda/gemm.h"

namespace nibble::cuda {
namespace {

// The entry points used, resolved from the shared library (the toolkit's libcublasLt is ~500 MB:
// loaded only by a process that runs a prefill-sized dense GEMM, and optional).
struct CublasLt {
  void* handle = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
};
constexpr size_t kWorkspaceBytes = size_t(32) << 20;

std::string load_error;

CublasLt* load() {
  static CublasLt lib;
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("NIBBLE_NO_CUBLASLT")) {
      load_error = "NIBBLE_NO_CUBLASLT is set";
      return;
    }
    for (const char* name : {"libcublasLt.so.13", "libcublasLt.so", "/usr/local/cuda/lib64/libcublasLt.so.13",
                             "/usr/local/cuda/lib64/libcublasLt.so"})
      if ((lib.handle = dlopen(name, RTLD_NOW | RTLD_LOCAL))) break;
    if (!lib.handle) {
      load_error = "libcublasLt.so was not found";
      return;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib.handle, name));
      return fn != nullptr;
    };
    if (!sym(lib.create, "cublasLtCreate") || !sym(lib.desc_create, "cublasLtMatmulDescCreate") ||
        !sym(lib.desc_set, "cublasLtMatmulDescSetAttribute") || !sym(lib.layout_create, "cublasLtMatrixLayoutCreate") ||
        !sym(lib.pref_create, "cublasLtMatmulPreferenceCreate") ||
        !sym(lib.pref_set, "cublasLtMatmulPreferenceSetAttribute") ||
        !sym(lib.heuristic, "cublasLtMatmulAlgoGetHeuristic") || !sym(lib.matmul, "cublasLtMatmul")) {
      load_error = "libcublasLt.so lacks the matmul API";
      return;
    }
    if (lib.create(&lib.lt) != CUBLAS_STATUS_SUCCESS || cudaMalloc(&lib.workspace, kWorkspaceBytes) != cudaSuccess) {
      cudaGetLastError();
      load_error = "cublasLtCreate or its workspace failed";
      lib.lt = nullptr;
    }
  });
  return lib.lt ? &lib : nullptr;
}

// One GEMM form: descriptors and the heuristic's algorithm, made once per shape (kept for the
// process, like the kernels' shared-memory opt-ins). ok false: cuBLASLt declined it.
struct Plan {
  bool ok = false;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

// y (n x m column-major = [m][n] row-major) = op(W: k x n column-major = [n][k] row-major)ᵀ · x
// (k x m column-major = [m][k] row-major) (+ bias); beta, given at the call, adds y.
const Plan& plan(CublasLt& lib, Dense type, int64_t m, int64_t n, int64_t k, bool bias) {
  static std::map<std::tuple<int, int64_t, int64_t, int64_t, bool>, Plan> plans;
  Plan& p = plans[{int(type), m, n, k, bias}];
  if (p.desc) return p;
  const cudaDataType_t t = type == Dense::kBF16 ? CUDA_R_16BF : CUDA_R_16F;
  if (lib.desc_create(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return p;
  const cublasOperation_t trans = CUBLAS_OP_T, none = CUBLAS_OP_N;
  lib.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof trans);
  lib.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof none);
  if (bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const int32_t bias_type = CUDA_R_32F;
    lib.desc_set(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue);
    lib.desc_set(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type);
  }
  if (lib.layout_create(&p.a, t, uint64_t(k), uint64_t(n), k) != CUBLAS_STATUS_SUCCESS ||
      lib.layout_create(&p.b, t, uint64_t(k), uint64_t(m), k) != CUBLAS_STATUS_SUCCESS ||
      lib.layout_create(&p.c, CUDA_R_32F, uint64_t(n), uint64_t(m), n) != CUBLAS_STATUS_SUCCESS)
    return p;
  cublasLtMatmulPreference_t pref = nullptr;
  if (lib.pref_create(&pref) != CUBLAS_STATUS_SUCCESS) return p;
  const size_t ws = kWorkspaceBytes;
  lib.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (lib.heuristic(lib.lt, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found) == CUBLAS_STATUS_SUCCESS &&
      found > 0) {
    p.algo = result.algo;
    p.ok = true;
  }
  return p;
}

std::mutex mutex;

}  // namespace

const char* cublaslt_unavailable_reason() {
  load();
  return load_error.c_str();
}

bool cublaslt_gemm_split(Dense type, const void* w, const float* bias, const float* x, float* y, int64_t m, int64_t n,
                         int64_t k, void* scratch) {
  if (type == Dense::kF32 || k % 8 != 0) return false;
  std::lock_guard<std::mutex> lock(mutex);
  CublasLt* lib = load();
  if (!lib) return false;
  const Plan& first = plan(*lib, type, m, n, k, bias != nullptr);
  const Plan& second = plan(*lib, type, m, n, k, false);
  if (!first.ok || !second.ok) return false;
  void* hi = scratch;
  void* lo = static_cast<char*>(scratch) + m * k * 2;
  split_16bit(type, x, m * k, hi, lo);
  if (bias) lib->desc_set(first.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
  const float one = 1.f, zero = 0.f;
  const cudaStream_t stream = cudaStreamPerThread;
  if (lib->matmul(lib->lt, first.desc, &one, w, first.a, hi, first.b, &zero, y, first.c, y, first.c, &first.algo,
                  lib->workspace, kWorkspaceBytes, stream) != CUBLAS_STATUS_SUCCESS ||
      lib->matmul(lib->lt, second.desc, &one, w, second.a, lo, second.b, &one, y, second.c, y, second.c,
                  &second.algo, lib->workspace, kWorkspaceBytes, stream) != CUBLAS_STATUS_SUCCESS)
    return false;
  return true;
}

}  // namespace nibble::cuda
