// Where a decode kernel releases its PDL successor (kernels/pdl.cuh): the kernels' sites and places,
// shared by the kernels and the host's parser of NIBBLE_PDL_TRIGGER (backend/pdl_trigger.h), so
// neither copies the other's numbering.
#pragma once

namespace nibble::kernels {

enum PdlSite : int {
  kPdlQkv = 0,
  kPdlO = 1,
  kPdlRouter = 2,
  kPdlGateUp = 3,
  kPdlDown = 4,
  kPdlAttention = 5,
  kPdlOFold = 6,  // the o GEMV with the MoE router folded in (its successor is MoE gate/up)
  kPdlSites = 7,
  kPdlNoSite = -1,
};
// The override's names, in PdlSite order.
inline constexpr const char* kPdlSiteNames[kPdlSites] = {"qkv", "o", "router", "up", "down", "attention", "ofold"};

enum PdlWhere : unsigned {
  kPdlAtWait = 0,         // as soon as the block passes its wait
  kPdlAfterInput = 1,     // once the block has staged its input (the activations it reads from L2)
  kPdlAfterProducts = 2,  // once its products (attention: its loop) are done, before it reduces and stores
  kPdlAtExit = 3,         // not at all: the successor starts as the block exits
};
// Attention's place 1 is once its warps' rows are in shared memory for the merge (after its loop:
// its input is staged as it goes).

}  // namespace nibble::kernels
