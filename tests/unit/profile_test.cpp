// bench --profile's attribution of a traced decode step (bench/profile.h), on synthetic spans.
#include <gtest/gtest.h>

#include "bench/profile.h"

namespace nibble {
namespace {

const ProfileRow& row(const std::vector<ProfileRow>& rows, const std::string& name) {
  for (const ProfileRow& r : rows)
    if (r.name == name) return r;
  static ProfileRow none;
  ADD_FAILURE() << "no row " << name;
  return none;
}

TEST(Profile, KernelNames) {
  EXPECT_EQ(kernel_base_name("_ZN6nibble7kernels16gemv_int4_kernelILi1ELi1ELi4ELb1EEEvNS0_8Int4GemvE"), "gemv_int4_kernel");
  EXPECT_EQ(kernel_base_name("memcpy device to host"), "memcpy device to host");
  EXPECT_EQ(kernel_category("moe_gate_up_int4_kernel"), "experts (INT4)");
  EXPECT_EQ(kernel_category("moe_router_kernel"), "router + routing");
  EXPECT_EQ(kernel_category("attention_split_gqa_kernel"), "attention");
  EXPECT_EQ(kernel_category("moe_mxfp4_down_kernel"), "experts (MXFP4)");
  EXPECT_EQ(kernel_category("gemv_mxfp4_mma_kernel"), "projections (MXFP4)");
  EXPECT_EQ(kernel_category("moe_group_scan_kernel"), "expert grouping + combine");
  EXPECT_EQ(kernel_category("flash_attention_prefill_kernel"), "attention");
  EXPECT_EQ(kernel_category("nvjet_sm90_tss_192x128_64x5_1x4_h_bz_coopB_bias_TNT"), "dense GEMM (cuBLASLt)");
}

TEST(Profile, CriticalPathAttribution) {
  // Two steps. Step 1: a [0, 10) us, b overlaps it (starts at 5, PDL) and ends at 14, a 2 us gap,
  // c [16, 20); then the host for 30 us; step 2 the same shifted by 50 us.
  std::vector<KernelSpan> spans;
  for (uint64_t base : {0u, 50000u}) {
    spans.push_back({"_ZN6nibble7kernels1aEv", base + 0, base + 10000});
    spans.push_back({"_ZN6nibble7kernels1bEv", base + 5000, base + 14000});
    spans.push_back({"_ZN6nibble7kernels1cEv", base + 16000, base + 20000});
  }
  const StepProfile p = profile_steps(spans, 2);
  EXPECT_DOUBLE_EQ(p.step_us, 35.0);  // 70 us over 2 steps
  EXPECT_DOUBLE_EQ(row(p.kernels, "a").us_per_step, 10.0);
  EXPECT_DOUBLE_EQ(row(p.kernels, "b").us_per_step, 4.0);  // only past a's end
  EXPECT_DOUBLE_EQ(row(p.kernels, "c").us_per_step, 4.0);
  EXPECT_DOUBLE_EQ(row(p.kernels, "c").calls_per_step, 1.0);
  EXPECT_DOUBLE_EQ(row(p.kernels, "(gaps between kernels)").us_per_step, 2.0);
  EXPECT_DOUBLE_EQ(row(p.kernels, "(host between steps)").us_per_step, 15.0);  // one 30 us gap over 2 steps
  double total = 0;
  for (const ProfileRow& r : p.categories) total += r.us_per_step;
  EXPECT_DOUBLE_EQ(total, p.step_us);  // the categories account for the whole span
}

}  // namespace
}  // namespace nibble
