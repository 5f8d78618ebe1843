#include "backend/pdl_trigger.h"

#include <gtest/gtest.h>

#include "kernels/pdl_sites.h"

namespace nibble {
namespace {

uint32_t place(int site, unsigned where) { return uint32_t(where + 1) << (3 * site); }

TEST(PdlTriggerTest, ParsesSitesAndPlaces) {
  uint32_t bits = 123;
  std::string why;
  ASSERT_TRUE(parse_pdl_trigger("", &bits, &why));
  EXPECT_EQ(bits, 0u);
  ASSERT_TRUE(parse_pdl_trigger("qkv=0,o=2,attention=3", &bits, &why)) << why;
  EXPECT_EQ(bits, place(kernels::kPdlQkv, 0) | place(kernels::kPdlO, 2) | place(kernels::kPdlAttention, 3));
  ASSERT_TRUE(parse_pdl_trigger("down=1", &bits, &why)) << why;
  EXPECT_EQ(bits, place(kernels::kPdlDown, 1));
  ASSERT_TRUE(parse_pdl_trigger("ofold=1,o=0", &bits, &why)) << why;
  EXPECT_EQ(bits, place(kernels::kPdlOFold, 1) | place(kernels::kPdlO, 0));
  // An override of place 0 differs from none: the kernel's default may be another place.
  EXPECT_NE(place(kernels::kPdlRouter, 0), 0u);
}

TEST(PdlTriggerTest, RejectsMalformedSpecsByName) {
  uint32_t bits = 0;
  for (const char* bad : {"qkv", "qkv=4", "qkv=", "qkv=10", "ov=1", "o=1,", "=1", "o=1,,router=2", "attn=2"}) {
    std::string why;
    EXPECT_FALSE(parse_pdl_trigger(bad, &bits, &why)) << bad;
    EXPECT_NE(why.find("NIBBLE_PDL_TRIGGER"), std::string::npos) << bad;
    EXPECT_NE(why.find("sites qkv, o, router, up, down, attention, ofold"), std::string::npos) << bad;
  }
}

}  // namespace
}  // namespace nibble
