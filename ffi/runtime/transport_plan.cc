// Transport planning (transport_plan.h): pure functions of what NCCL said
// about the peers, tested without a GPU through the bindings.
#include "transport_plan.h"

#include <string>

namespace jax_ep {

int FirstBit(uint32_t mask) {
  for (int j = 0; j < 32; ++j)
    if ((mask >> j) & 1u) return j;
  return -1;
}

std::string NcclVersionString(int code) {
  // NCCL_VERSION() packs X.Y.Z as X*1000+Y*100+Z up to 2.8 and X*10000+Y*100+Z after.
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? (code % 10000) / 100 : (code % 1000) / 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

namespace {

// "" when nothing stands in GIN's way before it is set up.
std::string GinSupportReason(GinSupport gin, int nccl_version) {
  const std::string nccl = "NCCL " + NcclVersionString(nccl_version);
  switch (gin) {
    case GinSupport::kNotBuilt:
      return "this jax_ep was built without NCCL's GIN device API (built against " + nccl +
             " headers; GIN came with NCCL 2.28.7)";
    case GinSupport::kNoDevice:
      return nccl + " reports no GIN-capable network device for this communicator (GIN needs "
             "an InfiniBand/RoCE NIC that NCCL drives with GPUDirect RDMA on every rank, and "
             "NCCL_GIN_ENABLE not 0)";
    case GinSupport::kRailOnly:
      return nccl + " offers GIN only between GPUs on the same rail, and jax_ep needs a GIN "
             "connection to every remote peer";
    case GinSupport::kUntested:
    case GinSupport::kAvailable:
      break;
  }
  return "";
}

}  // namespace

std::string NoTransportMessage(const TransportInputs& in, int peer, const std::string& gin_why) {
  const int n = static_cast<int>(in.lsa_member.size());
  int lsa_size = 0;
  for (bool member : in.lsa_member) lsa_size += member ? 1 : 0;
  const bool in_lsa = peer >= 0 && peer < n && in.lsa_member[peer];
  std::string msg = "jax_ep: no transport from EP rank " + std::to_string(in.rank) + " (device " +
                    std::to_string(in.device_ordinal) + ") to EP rank " + std::to_string(peer) +
                    ": ";
  if (in.emulate_gin) {
    msg += "transport 'gin_emulated' (Communicator.create(transport=...)) carries GIN over NVLink, and this peer is outside "
           "NCCL's LSA (NVLink load/store) team of rank " + std::to_string(in.rank) + " (" +
           std::to_string(lsa_size) + " of " + std::to_string(n) + " ranks are in it). " +
           gin_why + ". Use transport='auto'.";
    return msg;
  }
  if (in.force_gin && in_lsa) {
    msg += "transport 'gin' (Communicator.create(transport=...)) puts every remote peer on GIN, although this one is in NCCL's "
           "LSA (NVLink load/store) team";
  } else {
    msg += "it is outside NCCL's LSA (NVLink load/store) team of rank " + std::to_string(in.rank) +
           ", which holds " + std::to_string(lsa_size) + " of " + std::to_string(n) +
           " ranks (another host, or no NVLink/P2P path between the GPUs)";
  }
  msg += ", so it must be reached by GIN (GPU-initiated RDMA through a network card), but " +
         gin_why + ". ";
  if (in.force_gin) {
    msg += "Use transport='auto' to reach LSA peers over NVLink.";
  } else {
    msg += "Put the EP axis on GPUs of one NVLink domain, or run where every host has a "
           "GIN-capable NIC, with jax_ep built against the NCCL (>= 2.28.7) that JAX loads.";
  }
  return msg;
}

TransportPlan PlanTransports(const TransportInputs& in) {
  TransportPlan plan;
  const int n = static_cast<int>(in.lsa_member.size());
  plan.per_peer.assign(n, Transport::kLsa);
  for (int j = 0; j < n; ++j) {
    if (j == in.rank) {
      plan.per_peer[j] = Transport::kSelf;
    } else if (in.force_gin || !in.lsa_member[j]) {
      plan.per_peer[j] = Transport::kGin;
      plan.gin_mask |= 1u << j;
    }
  }
  if (in.emulate_gin) {
    // Emulated puts are NVLink stores: every GIN peer must be an LSA peer.
    plan.gin_emulated = plan.gin_mask != 0;
    for (int j = 0; j < n && plan.error.empty(); ++j) {
      if (((plan.gin_mask >> j) & 1u) && !in.lsa_member[j])
        plan.error = NoTransportMessage(in, j, "Emulated GIN needs every peer in that team");
    }
  } else if (plan.gin_mask != 0) {
    const std::string why = GinSupportReason(in.gin, in.nccl_version);
    if (!why.empty()) plan.error = NoTransportMessage(in, FirstBit(plan.gin_mask), why);
  }
  return plan;
}

}  // namespace jax_ep
