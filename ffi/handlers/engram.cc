// FFI targets "jax_ep_engram_publish", "jax_ep_engram_fetch",
// "jax_ep_engram_publish_fetch" (execute stage; instantiate is the shared
// one in bindings.cc) and "jax_ep_engram_grad". Mirrored by
// jax_ep/_ffi/engram.py. Window layout: kernels/engram_layout.h.
// num_sms i32 on each: 0 the kernel's own count, n > 0 at most n SMs.
//
// jax_ep_engram_publish
//   attrs: comm_id i64, table_end_offset i64 (bytes between the table's end
//          and the window's end: the tables published above it),
//          reserved_bytes i64 (window bytes from the base that
//          the normal ops of the same program need; the table goes above),
//          num_sms i32 (the publish takes one CTA and the copy engine,
//          within any n >= 1)
//   args:  table [V/R, D] bf16/f16/f32/f8e4m3fn (this rank's shard)
//   rets:  token s32 [1] (this area's publish version, >= 1, or 0 if the
//          publish failed; feed it to fetch so XLA orders them, and the
//          fetch checks it is still the area's current version:
//          engram_versions.h)
// jax_ep_engram_fetch
//   attrs: comm_id i64, rows_per_rank i64 (V/R), reserved_bytes i64 and
//          table_end_offset i64 (as for the publish), num_sms i32 (0 = model)
//   args:  token s32 [1], indices s32 [T, e] (global row ids in [-1, V))
//   rets:  rows [T, e, D] of the published table's dtype
//   With a GIN peer the rows of its shard come by request and answer
//   (kernels/engram_gin.cu), through scratch above reserved_bytes that the
//   window must hold too (kernels/engram_layout.h EngramGinArea).
// jax_ep_engram_publish_fetch (both in one call: what the public op uses)
//   attrs: comm_id i64, reserved_bytes i64, num_sms i32
//   args:  table [V/R, D], indices s32 [T, e]
//   rets:  rows [T, e, D] of table's dtype
//
// Why the fused target: XLA orders a fetch after the publish whose token it
// takes, but nothing orders a second publish after the first table's fetches
// (no data dependence), so two publish/fetch pairs in one program could run
// as publish A, publish B, fetch A. One custom call per lookup cannot be
// split that way. The two-target form is for "publish once, fetch many";
// its caller must make any later publish depend on the fetches' outputs.
// If it does not, a fetch that runs after a later publish into its area
// reports a stale publication (zeros, Cause::kStalePublication) instead of
// silently reading the newer table.
#include <cstdint>
#include <string>

#include "handlers/state.h"
#include "kernels/engram.cuh"
#include "kernels/engram_grad.h"
#include "kernels/engram_layout.h"

namespace jax_ep {
namespace {

bool TableDtype(ffi::DataType t) {
  return t == ffi::DataType::BF16 || t == ffi::DataType::F16 || t == ffi::DataType::F32 ||
         t == ffi::DataType::F8E4M3FN;
}

// The same placement check for both targets (they must agree on table_off).
// gin_bytes: the fetch's GIN scratch below the tables (0 for a publish, or
// without GIN peers).
ffi::Error PlaceTable(const char* op, const DeviceResources& dev, int64_t rows_per_rank,
                      size_t row_bytes, int64_t reserved_bytes, int64_t end_offset,
                      EngramWindow* w, size_t gin_bytes = 0) {
  if (reserved_bytes < 0) return Invalid(op, "reserved_bytes must be >= 0");
  if (end_offset < 0) return Invalid(op, "table_end_offset must be >= 0");
  *w = EngramWindow(dev.window_bytes, rows_per_rank, row_bytes, static_cast<size_t>(reserved_bytes),
                    static_cast<size_t>(end_offset), gin_bytes);
  if (!w->fits && gin_bytes > 0) {
    return Invalid(op, "the symmetric window is too small for an Engram fetch with GIN peers: it "
                       "needs " + std::to_string(w->need) + " bytes (" + std::to_string(gin_bytes) +
                       " for the request/answer scratch of this fetch above reserved_bytes=" +
                       std::to_string(reserved_bytes) + ", then the table shard of " +
                       std::to_string(w->table_bytes) + " bytes and " + std::to_string(end_offset) +
                       " bytes of the tables published above it) but the Communicator has " +
                       std::to_string(dev.window_bytes) + "; create it with num_bytes >= " +
                       std::to_string(w->need) + " (jax_ep._window.engram_bytes(..., gin_ranks=R, "
                       "gin_rows=T*e))");
  }
  if (!w->fits) {
    return Invalid(op, "the symmetric window is too small for the Engram table: it needs " +
                           std::to_string(w->need) + " bytes (" + std::to_string(w->table_bytes) +
                           " for the table shard [" + std::to_string(rows_per_rank) + " rows x " +
                           std::to_string(row_bytes) + " bytes] placed " +
                           std::to_string(end_offset) + " bytes below the end of the window "
                           "(the tables published above it), above " +
                           std::to_string(w->need - w->table_bytes - end_offset) +
                           " bytes for the runtime header and reserved_bytes=" +
                           std::to_string(reserved_bytes) + " of dispatch/combine) but the "
                           "Communicator has " + std::to_string(dev.window_bytes) +
                           "; create it with num_bytes >= " + std::to_string(w->need));
  }
  return ffi::Error::Success();
}

// Checks `table` and fills the publish launch (except the token).
ffi::Error PreparePublish(const char* op, const DeviceResources& dev, ffi::AnyBuffer& table,
                          int64_t reserved_bytes, int64_t end_offset, EngramPublishArgs* a) {
  const auto td = table.dimensions();
  if (td.size() != 2) return Invalid(op, "table must be the local shard [V/R, D], got " + Dims(td));
  if (!TableDtype(table.element_type()))
    return Invalid(op, "table dtype must be bf16, f16, f32 or float8_e4m3fn");
  if (td[0] < 1) return Invalid(op, "table must have at least one row");
  const size_t row_bytes = static_cast<size_t>(td[1]) * ffi::ByteWidth(table.element_type());
  if (row_bytes == 0 || row_bytes % 16 != 0)
    return Invalid(op, "row bytes (D * dtype bytes = " + std::to_string(row_bytes) +
                           ") must be a positive multiple of 16");
  EngramWindow w(0, 0, 0, 0);
  if (ffi::Error err = PlaceTable(op, dev, td[0], row_bytes, reserved_bytes, end_offset, &w);
      err.failure()) {
    return err;
  }
  a->table = table.untyped_data();
  a->table_bytes = w.table_bytes;
  a->table_off = w.table_off;
  a->rows_per_rank = td[0];
  a->row_bytes = row_bytes;
  a->versions = dev.engram_words();
  a->slot = dev.engram_versions->Publish(a->table_off, a->table_bytes, &a->clear);
  if (a->slot < 0) {
    return Invalid(op, "more than " + std::to_string(kEngramSlots) + " distinct Engram table "
                   "placements (offset, size) on this Communicator; create a new one");
  }
  return ffi::Error::Success();
}

// Checks indices / rows and fills the fetch launch.
ffi::Error PrepareFetch(const char* op, const DeviceResources& dev, ffi::Buffer<ffi::S32>& indices,
                        ffi::Result<ffi::AnyBuffer>& rows, int64_t rows_per_rank,
                        int64_t reserved_bytes, int64_t end_offset, int32_t num_sms,
                        EngramFetchArgs* a, EngramGinFetchArgs* gin) {
  const auto id = indices.dimensions();
  const auto od = rows->dimensions();
  if (id.size() != 2) return Invalid(op, "indices must be [T, e], got " + Dims(id));
  if (od.size() != 3 || od[0] != id[0] || od[1] != id[1])
    return Invalid(op, "rows must be [T, e, D] with [T, e] = indices' shape, got " + Dims(od));
  if (!TableDtype(rows->element_type()))
    return Invalid(op, "rows dtype must be bf16, f16, f32 or float8_e4m3fn");
  if (rows_per_rank < 1) return Invalid(op, "rows_per_rank must be >= 1");
  const int64_t R = dev.nranks > 0 ? dev.nranks : 1;
  if (rows_per_rank > (int64_t{1} << 31) / R)
    return Invalid(op, "V = rows_per_rank * R must fit in int32 indices");
  const size_t row_bytes = static_cast<size_t>(od[2]) * ffi::ByteWidth(rows->element_type());
  if (row_bytes == 0 || row_bytes % 16 != 0)
    return Invalid(op, "row bytes (D * dtype bytes = " + std::to_string(row_bytes) +
                           ") must be a positive multiple of 16");
  const int64_t n = id[0] * id[1];
  if (n > 0 && static_cast<uint64_t>(n) * row_bytes >= (uint64_t{1} << 31))
    return Invalid(op, "T * e * row bytes must be < 2^31 (split the lookup)");
  // With a GIN peer the rows of its shard come by request and answer
  // through scratch sized by this fetch (engram_layout.h EngramGinArea).
  const size_t gin_bytes = dev.gin_mask != 0 ? EngramGinArea::Bytes(dev.nranks, n, row_bytes) : 0;
  EngramWindow w(0, 0, 0, 0);
  if (ffi::Error err = PlaceTable(op, dev, rows_per_rank, row_bytes, reserved_bytes, end_offset, &w,
                                  gin_bytes);
      err.failure()) {
    return err;
  }
  if (gin_bytes > 0) {
    gin->counters = dev.counters;
    gin->area = EngramGinArea(w.gin_off, dev.nranks, n, row_bytes);
  }
  a->indices = indices.typed_data();
  a->num_rows = n;
  a->rows_per_rank = rows_per_rank;
  a->row_bytes = row_bytes;
  a->table_off = w.table_off;
  a->out = rows->untyped_data();
  a->num_sms = num_sms;
  return ffi::Error::Success();
}

ffi::Error EngramPublishExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                                int64_t comm_id, int64_t reserved_bytes,
                                int64_t table_end_offset, int32_t num_sms, ffi::AnyBuffer table,
                                ffi::Result<ffi::Buffer<ffi::S32>> token) {
  constexpr const char* kOp = "engram_publish";
  (void)num_sms;  // one CTA: within any n >= 1 (LaunchEngramPublish)
  DeviceLease lease;
  if (ffi::Error err = AcquireDevice(state, comm_id, device_ordinal, kOp, lease, /*gin_data_path=*/true);
      err.failure()) {
    return err;
  }
  RefusalNotice notice(lease, stream, kEngramPublishBarriers);
  // A publish writes the window; a pending start's kernels may be using it.
  if (ffi::Error err = RefuseWhileStartPending(*lease.dev, kOp, stream); err.failure()) return err;
  if (token->element_count() != 1) return Invalid(kOp, "token must be s32 [1]");
  EngramPublishArgs a;
  if (ffi::Error err = PreparePublish(kOp, *lease.dev, table, reserved_bytes, table_end_offset, &a);
      err.failure()) {
    return err;
  }
  a.token = token->typed_data();
  notice.Launched();
  if (cudaError_t err = LaunchEngramPublish(a, lease.dev->peers(), stream); err != cudaSuccess) {
    return CudaError(err, "engram_publish launch");
  }
  return EndCall(lease, stream);
}

ffi::Error EngramFetchExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                              int64_t comm_id, int64_t rows_per_rank, int64_t reserved_bytes,
                              int64_t table_end_offset, int32_t num_sms, ffi::Buffer<ffi::S32> token,
                              ffi::Buffer<ffi::S32> indices, ffi::Result<ffi::AnyBuffer> rows) {
  constexpr const char* kOp = "engram_fetch";
  DeviceLease lease;
  if (ffi::Error err = AcquireDevice(state, comm_id, device_ordinal, kOp, lease, /*gin_data_path=*/true);
      err.failure()) {
    return err;
  }
  RefusalNotice notice(lease, stream, 0, Op::kNone, /*engram_fetch=*/true);
  if (token.element_count() != 1) return Invalid(kOp, "token must be the s32 [1] of engram_publish");
  EngramFetchArgs a;
  EngramGinFetchArgs gin;
  if (ffi::Error err = PrepareFetch(kOp, *lease.dev, indices, rows, rows_per_rank, reserved_bytes,
                                    table_end_offset, num_sms, &a, &gin);
      err.failure()) {
    return err;
  }
  a.token = token.typed_data();
  const int slot = lease.dev->engram_versions->Slot(
      a.table_off, static_cast<size_t>(a.rows_per_rank) * a.row_bytes);
  a.version = slot < 0 ? nullptr : lease.dev->engram_words() + 1 + slot;
  notice.Launched();
  if (cudaError_t err = LaunchEngramFetch(a, lease.dev->peers(), stream, gin); err != cudaSuccess) {
    return CudaError(err, "engram_fetch launch");
  }
  return EndCall(lease, stream);
}

ffi::Error EngramPublishFetchExecute(cudaStream_t stream, int32_t device_ordinal, CommState* state,
                                    int64_t comm_id, int64_t reserved_bytes, int32_t num_sms,
                                    ffi::AnyBuffer table, ffi::Buffer<ffi::S32> indices,
                                    ffi::Result<ffi::AnyBuffer> rows) {
  constexpr const char* kOp = "engram_fetch";
  DeviceLease lease;
  if (ffi::Error err = AcquireDevice(state, comm_id, device_ordinal, kOp, lease, /*gin_data_path=*/true);
      err.failure()) {
    return err;
  }
  // A refusal stands in for the publish's barriers, then the fetch's exchange.
  RefusalNotice notice(lease, stream, kEngramPublishBarriers, Op::kNone, /*engram_fetch=*/true);
  // A publish writes the window; a pending start's kernels may be using it.
  if (ffi::Error err = RefuseWhileStartPending(*lease.dev, kOp, stream); err.failure()) return err;
  if (rows->element_type() != table.element_type())
    return Invalid(kOp, "rows must have the table's dtype");
  if (rows->dimensions().size() == 3 && table.dimensions().size() == 2 &&
      rows->dimensions()[2] != table.dimensions()[1])
    return Invalid(kOp, "rows must be [T, e, D] with the table's D");
  EngramPublishArgs pa;
  // Every check of both halves runs before anything is enqueued: a failing
  // call enqueues no barrier, so the ranks' barrier sequences stay in step.
  if (ffi::Error err = PreparePublish(kOp, *lease.dev, table, reserved_bytes, /*end_offset=*/0, &pa);
      err.failure()) {
    return err;
  }
  EngramFetchArgs fa;
  EngramGinFetchArgs gin;
  if (ffi::Error err = PrepareFetch(kOp, *lease.dev, indices, rows, table.dimensions()[0],
                                    reserved_bytes, /*end_offset=*/0, num_sms, &fa, &gin);
      err.failure()) {
    return err;
  }
  const EpPeers peers = lease.dev->peers();
  notice.Launched();
  if (cudaError_t err = LaunchEngramPublish(pa, peers, stream); err != cudaSuccess) {
    return CudaError(err, "engram_fetch (publish) launch");
  }
  if (cudaError_t err = LaunchEngramFetch(fa, peers, stream, gin); err != cudaSuccess) {
    return CudaError(err, "engram_fetch launch");
  }
  return EndCall(lease, stream);
}

// jax_ep_engram_grad (stateless): rows s32 [n] sorted, order s32 [n] (d's
// row of each sorted entry), d f32 [n, D] -> g f32 [V/R, D], the ordered
// per-row sum (kernels/engram_grad.h); attrs: num_sms i32.
ffi::Error EngramGradExecute(cudaStream_t stream, int32_t num_sms, ffi::Buffer<ffi::S32> rows,
                             ffi::Buffer<ffi::S32> order, ffi::Buffer<ffi::F32> d,
                             ffi::Result<ffi::Buffer<ffi::F32>> g) {
  constexpr const char* kOp = "engram_fetch (table gradient)";
  const auto dd = d.dimensions(), gd = g->dimensions();
  if (dd.size() != 2 || gd.size() != 2 || dd[1] != gd[1])
    return Invalid(kOp, "d must be [n, D] and g [V/R, D], got " + Dims(dd) + " and " + Dims(gd));
  if (rows.element_count() != static_cast<size_t>(dd[0]) ||
      order.element_count() != static_cast<size_t>(dd[0]))
    return Invalid(kOp, "rows and order must be [n] with n = d.shape[0]");
  if (gd[0] >= (int64_t{1} << 31) || gd[1] >= (int64_t{1} << 31))
    return Invalid(kOp, "table dimensions must be below 2^31");
  if (cudaError_t err = LaunchOrderedRowSum(rows.typed_data(), order.typed_data(), d.typed_data(), dd[0],
                                            static_cast<int>(gd[1]), static_cast<int32_t>(gd[0]),
                                            g->typed_data(), num_sms, stream);
      err != cudaSuccess) {
    return CudaError(err, "engram table gradient launch");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpEngramPublishExecute, jax_ep::EngramPublishExecute,
                              jax_ep::BindEpExecute()
                                  .Attr<int64_t>("reserved_bytes")
                                  .Attr<int64_t>("table_end_offset")
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpEngramFetchExecute, jax_ep::EngramFetchExecute,
                              jax_ep::BindEpExecute()
                                  .Attr<int64_t>("rows_per_rank")
                                  .Attr<int64_t>("reserved_bytes")
                                  .Attr<int64_t>("table_end_offset")
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpEngramPublishFetchExecute, jax_ep::EngramPublishFetchExecute,
                              jax_ep::BindEpExecute()
                                  .Attr<int64_t>("reserved_bytes")
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpEngramGradExecute, jax_ep::EngramGradExecute,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int32_t>("num_sms")
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());
