// The status word (kernels/common.cuh: the first device-side error of a
// device, (op << 16) | (cause << 8) | detail) as the host reads it: which
// codes leave the communicator usable, and the message each one gives.
#pragma once

#include <cstdint>
#include <string>

namespace jax_ep {

// An error after which the communicator's cross-rank state may be out of
// step (a peer that did not arrive, low-latency calls out of order): the
// next op is refused rather than run. After the others (bad ids, overflow, bad Engram
// index, stale publication) the kernels left every shared word consistent,
// so the next op runs, its peers do not wait for it, and then it reports.
bool IsFatalStatus(uint32_t code);
// A peer that did not arrive within the timeout (it may be gone): the
// communicator is torn down without collective calls (CommResources::Close).
bool IsLostPeerStatus(uint32_t code);
// "jax_ep <op> (EP rank r, device d): <cause>" for a non-zero status code.
// `call`: the number of the op that reported it on its device (0: unknown).
std::string DescribeStatus(uint32_t code, int rank, int device_ordinal,
                           double timeout_s, unsigned long long call = 0);
// The message of the status word at `status_host` (mapped host memory,
// EpPeers::status) with a configuration mismatch's two values, or "" when
// it is 0; clears the word and the mismatch records. `code_out`: the code.
std::string TakeStatusWord(uint32_t* status_host, int rank, int device_ordinal, double timeout_s,
                           uint32_t* code_out = nullptr);

}  // namespace jax_ep
