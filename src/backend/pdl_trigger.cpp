#include "backend/pdl_trigger.h"

#include "kernels/pdl_sites.h"

namespace nibble {

bool parse_pdl_trigger(std::string_view spec, uint32_t* bits, std::string* why_not) {
  *bits = 0;
  if (spec.empty()) return true;
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t comma = spec.find(',', pos);
    const std::string_view item = spec.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
    const size_t eq = item.find('=');
    int site = -1;
    for (int i = 0; i < kernels::kPdlSites; ++i)
      if (eq != std::string_view::npos && item.substr(0, eq) == kernels::kPdlSiteNames[i]) site = i;
    if (site < 0 || eq + 2 != item.size() || item[eq + 1] < '0' || item[eq + 1] > '3') {
      std::string sites;
      for (int i = 0; i < kernels::kPdlSites; ++i) sites += std::string(i ? ", " : "") + kernels::kPdlSiteNames[i];
      *why_not = "NIBBLE_PDL_TRIGGER: '" + std::string(item) + "' is not site=place (sites " + sites + "; places 0-3)";
      return false;
    }
    *bits |= uint32_t(item[eq + 1] - '0' + 1) << (3 * site);
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return true;
}

}  // namespace nibble
