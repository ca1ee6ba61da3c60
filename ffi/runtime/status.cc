// The status word's texts (status.h): what a device-side error code means,
// and the mismatch detail a kernel leaves next to the word.
#include "status.h"

#include <cstdio>
#include <string>

#include "kernels/common.cuh"
#include "kernels/gin.cuh"

namespace jax_ep {

namespace {
// What each field of an op's OpConfig record means (the kernels that fill
// them: dispatch.cu, combine.cu, low_latency.cu, engram.cu); null: unused.
const char* const* ConfigFieldNames(uint32_t op) {
  static const char* const kNormal[kOpConfigFields] = {
      "tokens per rank", "hidden", "topk", "num_experts",
      "format (payload bytes | fp8 << 8 | expert layout << 16)"};
  static const char* const kLowLatency[kOpConfigFields] = {
      "tokens per rank", "hidden", "topk", "num_experts", "max_tokens",
      "low-latency area offset / 256 (from reserved_bytes)", "fp8"};
  static const char* const kEngram[kOpConfigFields] = {"rows per rank", "row bytes",
                                                        "table offset / 16 (from reserved_bytes)",
                                                        "rows per fetch (T * e; GIN peers)"};
  static const char* const kNone[kOpConfigFields] = {};
  switch (static_cast<Op>(op)) {
    case Op::kDispatch:
    case Op::kCombine: return kNormal;
    case Op::kLowLatencyDispatch:
    case Op::kLowLatencyCombine: return kLowLatency;
    case Op::kEngramFetch: return kEngram;
    default: return kNone;
  }
}

// ": hidden 7168 here, 4096 on EP rank 1; ..." from the two records the
// kernel left next to the status word (config_check.cuh); it wrote them
// before the word, so they are complete once the word is seen.
std::string ConfigMismatchDetail(uint32_t* status_host, int peer) {
  constexpr size_t kWords = kOpConfigBytes / 4;  // per record: tag, op, fields
  uint32_t rec[2][kWords] = {};
  volatile uint32_t* src = reinterpret_cast<volatile uint32_t*>(
      reinterpret_cast<char*>(status_host) + kStatusReportOffset);
  for (size_t i = 0; i < 2 * kWords; ++i) {
    rec[i / kWords][i % kWords] = src[i];
    src[i] = 0;
  }
  const std::string there = " on EP rank " + std::to_string(peer);
  if (rec[1][1] == 0) {  // a GIN peer's record is not mapped here (ReadConfig)
    return ": EP rank " + std::to_string(peer) + "'s values are not readable from here (GIN)";
  }
  if (rec[0][1] != rec[1][1] || rec[0][0] != rec[1][0]) {
    // Another op's record, or another call's: the peer is elsewhere (ops
    // with a barrier: the ranks called ops in different orders), or it
    // went on to its next call before its record could be read.
    return ": EP rank " + std::to_string(peer) + " is in another call at this point (the ranks "
           "called jax_ep ops in different orders, or it went on before its values could be read)";
  }
  const char* const* names = ConfigFieldNames(rec[0][1]);
  std::string out;
  for (int i = 0; i < kOpConfigFields; ++i) {
    if (rec[0][2 + i] == rec[1][2 + i]) continue;
    out += (out.empty() ? ": " : "; ") + std::string(names[i] ? names[i] : "field") + " " +
           std::to_string(rec[0][2 + i]) + " here, " + std::to_string(rec[1][2 + i]) + there;
  }
  return out;
}
}  // namespace

std::string TakeStatusWord(uint32_t* status_host, int rank, int device_ordinal, double timeout_s,
                           uint32_t* code_out) {
  // The device writes the word with system-scope atomics through the
  // mapping; a volatile read sees it without any stream synchronisation.
  volatile unsigned long long* word = reinterpret_cast<volatile unsigned long long*>(status_host);
  const unsigned long long v = *word;
  const uint32_t code = static_cast<uint32_t>(v);
  if (code_out != nullptr) *code_out = code;
  if (code == 0) return "";
  *word = 0;
  std::string msg = DescribeStatus(code, rank, device_ordinal, timeout_s, v >> 32);
  if (static_cast<Cause>((code >> 8) & 0xffu) == Cause::kConfigMismatch) {
    msg += ConfigMismatchDetail(status_host, static_cast<int>(code & 0xffu));
  }
  return msg;
}

bool IsLostPeerStatus(uint32_t code) {
  return static_cast<Cause>((code >> 8) & 0xffu) == Cause::kPeerTimeout && (code & 0x80u) == 0;
}

bool IsFatalStatus(uint32_t code) {
  if (code == 0) return false;
  switch (static_cast<Cause>((code >> 8) & 0xffu)) {
    case Cause::kBadExpertId:
    case Cause::kCapacityOverflow:
    case Cause::kBadIndex:
    case Cause::kStalePublication:
    // The refusing rank stood in for this call's barriers (kernels/abort.h):
    // the epochs are in step and it sent nothing. A mismatch is found
    // before any row moves, and both ranks pass both barriers.
    case Cause::kPeerRefused:
    case Cause::kConfigMismatch:
      return false;
    case Cause::kPeerTimeout:
      // 0x80: the peer took part but failed its own checks (it reports why);
      // only a peer that did not arrive leaves the barriers out of step.
      return (code & 0x80u) == 0;
    default:
      return true;
  }
}

std::string DescribeStatus(uint32_t code, int rank, int device_ordinal, double timeout_s,
                           unsigned long long call) {
  const uint32_t op = (code >> 16) & 0xffffu;
  const uint32_t cause = (code >> 8) & 0xffu;
  const uint32_t detail = code & 0xffu;
  const char* op_name = "unknown op";
  switch (static_cast<Op>(op)) {
    case Op::kNone: op_name = "(no op)"; break;
    case Op::kLayout: op_name = "get_dispatch_layout"; break;
    case Op::kProbe: op_name = "probe_all_to_all"; break;
    case Op::kDispatch: op_name = "dispatch"; break;
    case Op::kCombine: op_name = "combine"; break;
    case Op::kLowLatencyDispatch: op_name = "low_latency_dispatch"; break;
    case Op::kLowLatencyCombine: op_name = "low_latency_combine"; break;
    case Op::kEngramFetch: op_name = "engram_fetch"; break;
  }
  // Plain string building: iostreams' locale machinery crashed here once
  // (SIGSEGV inside ostream::operator<<(long) on the GPU image).
  std::string msg = std::string("jax_ep ") + op_name + " (EP rank " + std::to_string(rank) +
                    ", device " + std::to_string(device_ordinal) + "): ";
  switch (static_cast<Cause>(cause)) {
    case Cause::kBadExpertId:
      msg += "expert id out of range [-1, E) in topk_idx";
      break;
    case Cause::kCapacityOverflow:
      msg += "capacity overflow: more received rows than the static capacity; raise "
             "`capacity` (or leave it None for the worst case)";
      break;
    case Cause::kPeerTimeout:
      msg += "peer rank " + std::to_string(detail & 0x7fu) +
             ((detail & 0x80u) ? " failed this call (see its own error)"
                               : " did not arrive within " + std::to_string(timeout_s) + " s") +
             " (the communicator's barriers may now be out of step: close it and create a new "
             "one if later calls time out)";
      break;
    case Cause::kConfigMismatch:
      msg += "EP rank " + std::to_string(detail) +
             " called this op with another configuration (every rank must pass the same "
             "shapes, dtypes and options); nothing was sent and the outputs are zeros";
      break;
    case Cause::kPeerRefused:
      msg += "peer rank " + std::to_string(detail) +
             " refused this call before running it (its own error says why); this call "
             "stopped at once and returned zeros, and the communicator stays usable";
      break;
    case Cause::kBadIndex:
      msg += "index out of range: a row index outside [-1, V) in the Engram indices (those "
             "rows were returned as zeros)";
      break;
    case Cause::kStalePublication:
      msg += "stale publication: the PublishedTable fetched from was superseded by a later "
             "engram_publish (or fused engram_fetch) into the same window area, or overwritten "
             "by a dispatch / combine / low-latency call whose window area reaches it (pass "
             "their window need as reserved_bytes, or a larger window), or its publish failed; "
             "those rows were returned as zeros";
      break;
    case Cause::kOutOfOrder:
      msg += "a low-latency *_start came before the previous call's *_done (or the layout "
             "changed while a call was pending): sends and receives of one op must alternate; "
             "the communicator's low-latency state may be inconsistent";
      break;
    case Cause::kWindowTooSmall:
      msg += "symmetric window too small for this call; create the Communicator with a larger "
             "num_bytes (see get_buffer_size_hint)";
      break;
    case kGinUnavailable:
      msg += "GIN asked of peer rank " + std::to_string(detail) +
             ", which this communicator does not reach by GIN (a jax_ep bug)";
      break;
    default:
      msg += "device error cause " + std::to_string(cause) + " (detail " + std::to_string(detail) + ")";
  }
  char hex[32];
  std::snprintf(hex, sizeof(hex), " [status 0x%08x]", code);
  // Which call: the n-th jax_ep op on this device since the Communicator was
  // created (Communicator.info()[i]["calls"] is the count so far).
  const std::string which =
      call ? " [call " + std::to_string(call) + " on device " + std::to_string(device_ordinal) + "]" : "";
  return msg + which + hex;
}

}  // namespace jax_ep
