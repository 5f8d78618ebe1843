// Activation functions shared by the kernels that apply them: the elementwise kernel, the MoE
// decode and prefill epilogues. No kernels here, so any launcher file may include it.
#pragma once

namespace nibble::kernels {

// gpt-oss's SwiGLU: gate clamped above at `limit`, up to ±limit, (up + 1) · gate · σ(alpha · gate)
// (transformers' GptOssExperts).
__device__ __forceinline__ float clamped_swiglu(float gate, float up, float alpha, float limit) {
  const float g = fminf(gate, limit), u = fminf(fmaxf(up, -limit), limit);
  return (u + 1.f) * g / (1.f + expf(-alpha * g));
}

}  // namespace nibble::kernels
