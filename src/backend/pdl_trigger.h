// NIBBLE_PDL_TRIGGER=site=place,... : where the CUDA decode kernels release their successors,
// overriding each kernel's own place, for A/B runs (kernels/pdl.cuh, kernels/pdl_sites.h). Sites:
// qkv, o, router, up, down, attention, ofold (the o GEMV with the router folded in); places 0 at
// the wait, 1 after the block's input is staged, 2 after its products, 3 at exit (a kernel without
// the place named releases at its exit).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace nibble {

// The override as the kernels read it: three bits a site (kernels/pdl_sites.h order), 0 for none,
// else the place + 1. An empty spec is no override. False with the reason on a malformed spec.
bool parse_pdl_trigger(std::string_view spec, uint32_t* bits, std::string* why_not);

}  // namespace nibble
