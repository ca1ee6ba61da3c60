// Transport planning: which peer is reached by LSA (NVLink loads/stores,
// when it is in NCCL's LSA team of this rank) and which by GIN (GPU-initiated
// RDMA through a network card, kernels/gin.cuh), or the message that says
// why a peer cannot be reached. Pure functions: CreateComm (comm.cc) feeds
// them what NCCL reported, the CPU tests feed them made-up teams.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace jax_ep {

// How one rank reaches another.
enum class Transport : uint8_t { kSelf = 0, kLsa = 1, kGin = 2 };

// What jax_ep knows about GIN for a communicator before asking NCCL for a
// device communicator with GIN in it.
enum class GinSupport : uint8_t {
  kNotBuilt = 0,   // the NCCL headers of this build have no GIN device API
  kUntested = 1,   // this NCCL cannot tell beforehand (2.28): creating it tells
  kNoDevice = 2,   // NCCL found no GIN-capable network device on every rank
  kRailOnly = 3,   // GIN only between GPUs of one rail; jax_ep needs all peers
  kAvailable = 4,
};

struct TransportInputs {
  int rank = 0;
  int device_ordinal = -1;
  std::vector<bool> lsa_member;  // by EP rank: in NCCL's LSA team of `rank`
  bool force_gin = false;        // transport "gin" or "gin_emulated"
  bool emulate_gin = false;      // transport "gin_emulated" (with force_gin)
  GinSupport gin = GinSupport::kNotBuilt;
  int nccl_version = 0;          // NCCL_VERSION_CODE, for messages
};

struct TransportPlan {
  std::vector<Transport> per_peer;  // by EP rank
  uint32_t gin_mask = 0;            // bit j: per_peer[j] == kGin
  bool gin_emulated = false;        // those peers' GIN is emulated over NVLink
  std::string error;                // non-empty: some peer has no transport
};

// Pure: the transport of every peer, or the message naming the first peer
// that has none, why, and what to do.
TransportPlan PlanTransports(const TransportInputs& in);
// The message for a peer that needs GIN, when GIN cannot be had because of
// `gin_why` (a clause, e.g. "NCCL 2.28.9 could not set up GIN: ...").
std::string NoTransportMessage(const TransportInputs& in, int peer, const std::string& gin_why);
// "2.28.9" for 22809.
std::string NcclVersionString(int code);
// The lowest set bit of `mask` (a peer's rank), -1 when none.
int FirstBit(uint32_t mask);

}  // namespace jax_ep
