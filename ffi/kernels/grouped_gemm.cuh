// The grouped GEMM's device side (docs/grouped_gemm.md), included only by
// the grouped_gemm_<kind>.cu instance files: a CUTLASS 3 ptr-array grouped
// kernel for Hopper (TMA loads, warp-specialised cooperative consumers,
// wgmma), fed by a prep kernel that turns the device-resident group sizes
// into per-group shapes, pointers and strides.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/util/packed_stride.hpp>
#include <cutlass/detail/blockwise_scale_layout.hpp>

#include "kernels/grouped_gemm.h"

namespace jax_ep::gg {

using Problem = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using ProblemMNK = Problem::UnderlyingProblemShape;
using Bf16 = cutlass::bfloat16_t;

// The schedule (docs/grouped_gemm.md has the measurements that chose it):
// cooperative 128 x 256 x 64 tiles, no cluster, tiles ordered along M so the
// M tiles of one group's weight slice run together and meet in L2. Expert
// groups hold a few hundred rows, rarely a tile multiple: 128-row tiles
// waste at most one partial tile per group. Clusters sharing tiles by
// multicast measured equal or slower (benchmarks/RESULTS.md, 2026-12-01).
struct Schedule {
  using Tile = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// One CUTLASS grouped kernel: schedule, input element, the operands' global
// layouts (plain tags, or (tag, scale layout) tuples for blockwise FP8), and
// the output's element and layout. No C operand.
template <class Sched, class Element, class GmemA, class GmemB, class ElementD, class LayoutD>
struct GemmOf {
  using TileShape = typename Sched::Tile;
  using ClusterShape = typename Sched::Cluster;
  static constexpr int kAlignIn = 16 / sizeof(Element);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD*, kAlignD,
      ElementD, LayoutD*, kAlignD, typename Sched::Epi>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, GmemA, kAlignIn, Element,
      GmemB, kAlignIn, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Sched::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Problem, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using D = ElementD;
  using In = Element;
};

template <class LayoutA, class LayoutB, class ElementD, class Sched = Schedule,
          class LayoutD = cutlass::layout::RowMajor>
struct Config : GemmOf<Sched, Bf16, LayoutA*, LayoutB*, ElementD, LayoutD> {
  static constexpr bool kBlockScaled = false;
  using LayoutSFA = int;  // no scales
  using LayoutSFB = int;
};

// FP8 (e4m3 x e4m3) with DeepGEMM-style fine-grained scales, promoted into
// the f32 accumulators every 128 of K: x per (row, 128 channels), w per
// 128 x 128 block. CUTLASS's Hopper blockwise kernel reads both scale arrays
// M/N-major (the per-row scales of one 128-channel block contiguous) and
// both operands K-major.
struct Fp8Schedule {
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using Epi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// x's scales K-major: row m's H/128 scales contiguous, [rows, H/128], exactly
// as quantize and dispatch write them. The kernel reads each group's scales
// from its first row on, so no per-call regrouping pass is needed.
struct Fp8Scales {
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<
      1, 128, 128, cute::GMMA::Major::K, cute::GMMA::Major::MN>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
};

// Pingpong, for the masked decode form: each consumer warpgroup its own
// 64-row tile, one's epilogue and scale promotion overlapping the other's
// tensor-core work. The decode grid holds a few rows per group and is bound
// by reading the weights, which two tiles per SM in flight read faster; on
// full groups the cooperative 128-row tiles win (measured 2026-12-04).
struct Fp8PingpongSchedule {
  using Tile = cute::Shape<cute::_64, cute::_128, cute::_128>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
  using Epi = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

template <class ElementD, class Sched = Fp8Schedule>
struct Fp8Config
    : GemmOf<Sched, cutlass::float_e4m3_t,
             cute::tuple<cutlass::layout::RowMajor*, Fp8Scales::LayoutSFA*>,
             cute::tuple<cutlass::layout::ColumnMajor*, Fp8Scales::LayoutSFB*>, ElementD,
             cutlass::layout::RowMajor> {
  static constexpr bool kBlockScaled = true;
  using LayoutSFA = Fp8Scales::LayoutSFA;
  using LayoutSFB = Fp8Scales::LayoutSFB;
};

// FP8 weight gradient, dw[g] = x_g^T dy_g with K = the group's tokens. Both
// operands come transposed and quantised per (channel, 128 tokens), each
// group starting at a 128-token boundary of the padded token axis (zeros
// fill a group's last chunk): xT [H, Mpad], dyT [F, Mpad] e4m3, K-major as
// FP8 tensor cores need. Their scales are one per channel and chunk, stored
// chunk-major ([Mpad/128, H] and [Mpad/128, F]), so a group's scales are the
// contiguous rows of its chunks.
struct Fp8WgradScales {
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<
      1, 1, 128, cute::GMMA::Major::MN, cute::GMMA::Major::MN>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
};

struct Fp8WgradConfig
    : GemmOf<Fp8Schedule, cutlass::float_e4m3_t,
             cute::tuple<cutlass::layout::RowMajor*, Fp8WgradScales::LayoutSFA*>,
             cute::tuple<cutlass::layout::ColumnMajor*, Fp8WgradScales::LayoutSFB*>,
             cutlass::bfloat16_t, cutlass::layout::RowMajor> {
  static constexpr bool kBlockScaled = true;
  using LayoutSFA = Fp8WgradScales::LayoutSFA;
  using LayoutSFB = Fp8WgradScales::LayoutSFB;
};

// The per-group arrays the grouped kernel reads, carved from one scratch
// allocation in this order, each 256-aligned; CUTLASS's workspace follows.
template <class C>
struct Arrays {
  ProblemMNK* shapes;
  const typename C::In** a;
  const typename C::In** b;
  typename C::D** d;
  typename C::StrideA* sa;
  typename C::StrideB* sb;
  typename C::StrideD* sd;
  const float** sfa;  // FP8 only: scale pointers and layouts per group
  const float** sfb;
  typename C::LayoutSFA* lsfa;
  typename C::LayoutSFB* lsfb;
  int32_t* sizes;   // effective (clamped) rows per group
  int64_t* starts;  // first row of each group
  int64_t* total;   // rows covered by the groups (contiguous form)
  void* workspace;

  static size_t Align(size_t n) { return (n + 255) & ~size_t{255}; }
  static size_t ArraysBytes(const GroupedGemmArgs& args) {
    const int g = args.num_groups;
    return Align(sizeof(ProblemMNK) * g) + 3 * Align(sizeof(void*) * g) +
           Align(sizeof(typename C::StrideA) * g) + Align(sizeof(typename C::StrideB) * g) +
           Align(sizeof(typename C::StrideD) * g) + 2 * Align(sizeof(void*) * g) +
           Align(sizeof(typename C::LayoutSFA) * g) + Align(sizeof(typename C::LayoutSFB) * g) +
           Align(sizeof(int32_t) * g) + Align(sizeof(int64_t) * g) + Align(sizeof(int64_t));
  }
  static Arrays Carve(void* base, const GroupedGemmArgs& args) {
    const int g = args.num_groups;
    char* p = static_cast<char*>(base);
    Arrays r;
    auto take = [&](size_t n) {
      char* q = p;
      p += Align(n);
      return q;
    };
    r.shapes = reinterpret_cast<ProblemMNK*>(take(sizeof(ProblemMNK) * g));
    r.a = reinterpret_cast<const typename C::In**>(take(sizeof(void*) * g));
    r.b = reinterpret_cast<const typename C::In**>(take(sizeof(void*) * g));
    r.d = reinterpret_cast<typename C::D**>(take(sizeof(void*) * g));
    r.sa = reinterpret_cast<typename C::StrideA*>(take(sizeof(typename C::StrideA) * g));
    r.sb = reinterpret_cast<typename C::StrideB*>(take(sizeof(typename C::StrideB) * g));
    r.sd = reinterpret_cast<typename C::StrideD*>(take(sizeof(typename C::StrideD) * g));
    r.sfa = reinterpret_cast<const float**>(take(sizeof(void*) * g));
    r.sfb = reinterpret_cast<const float**>(take(sizeof(void*) * g));
    r.lsfa = reinterpret_cast<typename C::LayoutSFA*>(take(sizeof(typename C::LayoutSFA) * g));
    r.lsfb = reinterpret_cast<typename C::LayoutSFB*>(take(sizeof(typename C::LayoutSFB) * g));
    r.sizes = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * g));
    r.starts = reinterpret_cast<int64_t*>(take(sizeof(int64_t) * g));
    r.total = reinterpret_cast<int64_t*>(take(sizeof(int64_t)));
    r.workspace = p;
    return r;
  }
};

constexpr int kPrepThreads = 256;

// One block: scans the group sizes and writes every group's problem. Sizes
// are clamped so that no group reaches past `rows` (or past its slot in the
// masked form): the kernels never touch memory outside the buffers.
template <class C, GgKind kKind>
__global__ void __launch_bounds__(kPrepThreads) PrepGroups(GroupedGemmArgs args, Arrays<C> arr) {
  using Scan = cub::BlockScan<int64_t, kPrepThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  using In = typename C::In;
  const In* a = static_cast<const In*>(args.a);
  const In* b = static_cast<const In*>(args.b);
  auto* out = static_cast<typename C::D*>(args.out);
  const int64_t H = args.h, F = args.f;
  for (int base = 0; base < args.num_groups; base += kPrepThreads) {
    const int g = base + threadIdx.x;
    const bool live = g < args.num_groups;
    int64_t want = live ? args.group_sizes[g] : 0;
    if (want < 0) want = 0;
    // The FP8 weight gradient's groups start on 128-token chunks (its scale
    // granularity): a size that is not a chunk multiple is rounded up, as the
    // operands were padded.
    if constexpr (kKind == GgKind::kWeightGradFp8) want = (want + 127) / 128 * 128;
    if (args.group_stride > 0) want = want < args.group_stride ? want : args.group_stride;
    int64_t start = 0, chunk_total = 0;
    Scan(scan_tmp).ExclusiveSum(want, start, chunk_total);
    if (args.group_stride > 0) {
      start = static_cast<int64_t>(g) * args.group_stride;
    } else {
      start += carry;
    }
    int64_t rows = 0;
    if (start < args.rows) rows = want < args.rows - start ? want : args.rows - start;
    const int m = static_cast<int>(rows);
    if (live) {
      arr.sizes[g] = m;
      arr.starts[g] = start;
      if constexpr (kKind == GgKind::kForward) {
        arr.shapes[g] = ProblemMNK(m, static_cast<int>(F), static_cast<int>(H));
        arr.a[g] = a + start * H;
        arr.b[g] = b + g * H * F;
        arr.d[g] = out + start * F;
        arr.sa[g] = cutlass::make_cute_packed_stride(typename C::StrideA{}, {m, int(H), 1});
        arr.sb[g] = cutlass::make_cute_packed_stride(typename C::StrideB{}, {int(F), int(H), 1});
        arr.sd[g] = cutlass::make_cute_packed_stride(typename C::StrideD{}, {m, int(F), 1});
      } else if constexpr (kKind == GgKind::kTransW) {
        arr.shapes[g] = ProblemMNK(m, static_cast<int>(H), static_cast<int>(F));
        arr.a[g] = a + start * F;
        arr.b[g] = b + g * H * F;
        arr.d[g] = out + start * H;
        arr.sa[g] = cutlass::make_cute_packed_stride(typename C::StrideA{}, {m, int(F), 1});
        arr.sb[g] = cutlass::make_cute_packed_stride(typename C::StrideB{}, {int(H), int(F), 1});
        arr.sd[g] = cutlass::make_cute_packed_stride(typename C::StrideD{}, {m, int(H), 1});
      } else if constexpr (kKind == GgKind::kForwardFp8) {
        using namespace cute;
        const int h = static_cast<int>(H), f = static_cast<int>(F);
        const int kb = h / 128, nb = f / 128;
        arr.shapes[g] = ProblemMNK(m, f, h);
        arr.a[g] = a + start * H;
        arr.b[g] = b + g * H * F;
        arr.d[g] = out + start * F;
        arr.sa[g] = cutlass::make_cute_packed_stride(typename C::StrideA{}, {m, h, 1});
        arr.sb[g] = cutlass::make_cute_packed_stride(typename C::StrideB{}, {f, h, 1});
        arr.sd[g] = cutlass::make_cute_packed_stride(typename C::StrideD{}, {m, f, 1});
        // CUTLASS's grouped blockwise kernel derives each group's scale
        // layout from its problem shape (K-major: row stride H/128), so the
        // group's scales start at its first row; the layouts say the same.
        arr.sfa[g] = args.a_scales + start * kb;
        arr.lsfa[g] = typename C::LayoutSFA(
            make_shape(make_shape(Int<1>{}, m), make_shape(Int<128>{}, kb), 1),
            make_stride(make_stride(_0{}, kb), make_stride(_0{}, _1{}), m * kb));
        arr.sfb[g] = args.b_scales + static_cast<int64_t>(g) * kb * nb;
        arr.lsfb[g] = typename C::LayoutSFB(
            make_shape(make_shape(Int<128>{}, nb), make_shape(Int<128>{}, kb), 1),
            make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, nb), nb * kb));
      } else if constexpr (kKind == GgKind::kWeightGradFp8) {
        // a = xT [H, rows], b = dyT [F, rows] (rows = the padded token axis),
        // group g's K = m tokens from column `start`, both multiples of 128.
        using namespace cute;
        const int h = static_cast<int>(H), f = static_cast<int>(F);
        const int kc = m / 128;  // chunks of this group
        arr.shapes[g] = ProblemMNK(m > 0 ? h : 0, f, m);
        arr.a[g] = a + start;
        arr.b[g] = b + start;
        arr.d[g] = out + g * H * F;
        arr.sa[g] = cutlass::make_cute_packed_stride(typename C::StrideA{},
                                                     {h, static_cast<int>(args.rows), 1});
        arr.sb[g] = cutlass::make_cute_packed_stride(typename C::StrideB{},
                                                     {f, static_cast<int>(args.rows), 1});
        arr.sd[g] = cutlass::make_cute_packed_stride(typename C::StrideD{}, {h, f, 1});
        arr.sfa[g] = args.a_scales + (start / 128) * H;
        arr.lsfa[g] = typename C::LayoutSFA(
            make_shape(make_shape(Int<1>{}, h), make_shape(Int<128>{}, kc), 1),
            make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, h), h * kc));
        arr.sfb[g] = args.b_scales + (start / 128) * F;
        arr.lsfb[g] = typename C::LayoutSFB(
            make_shape(make_shape(Int<1>{}, f), make_shape(Int<128>{}, kc), 1),
            make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, f), f * kc));
      } else {
        // K = m. A group with no rows gets no tiles (M = 0): CUTLASS leaves
        // the accumulators uninitialised when K is 0, so ZeroEmptyGroups
        // writes its zeros instead.
        arr.shapes[g] = ProblemMNK(m > 0 ? static_cast<int>(H) : 0, static_cast<int>(F), m);
        arr.a[g] = a + start * H;
        arr.b[g] = b + start * F;
        arr.d[g] = out + g * H * F;
        arr.sa[g] = cutlass::make_cute_packed_stride(typename C::StrideA{}, {int(H), m, 1});
        arr.sb[g] = cutlass::make_cute_packed_stride(typename C::StrideB{}, {int(F), m, 1});
        arr.sd[g] = cutlass::make_cute_packed_stride(typename C::StrideD{}, {int(H), int(F), 1});
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) carry += chunk_total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int64_t t = carry < args.rows ? carry : args.rows;
    *arr.total = args.group_stride > 0 ? args.rows : t;
  }
}

// Internal linkage: every instance file carries its own copy of the fills.
namespace {

// Row outputs past the last group (contiguous form) are zeros, as
// lax.ragged_dot gives. 16-byte stores; row widths are multiples of 16 B.
__global__ void ZeroTailRows(uint4* out, int64_t row_vecs, int64_t rows, const int64_t* total) {
  const int64_t begin = *total * row_vecs;
  const int64_t end = rows * row_vecs;
  for (int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < end;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = make_uint4(0, 0, 0, 0);
  }
}

// Weight-gradient groups that received no rows are zeros.
__global__ void ZeroEmptyGroups(uint4* out, int64_t group_vecs, const int32_t* sizes) {
  if (sizes[blockIdx.y] > 0) return;
  uint4* o = out + blockIdx.y * group_vecs;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < group_vecs;
       i += int64_t(gridDim.x) * blockDim.x) {
    o[i] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace

template <class C>
typename C::Gemm::Arguments MakeArguments(const GroupedGemmArgs& args, const Arrays<C>& arr,
                                          int sms) {
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sms;
  typename C::Gemm::Arguments g{};
  g.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  g.problem_shape = {args.num_groups, arr.shapes, nullptr};
  if constexpr (C::kBlockScaled) {
    g.mainloop = {arr.a, arr.sa, arr.b, arr.sb, arr.sfa, arr.lsfa, arr.sfb, arr.lsfb};
  } else {
    g.mainloop = {arr.a, arr.sa, arr.b, arr.sb};
  }
  g.epilogue = {{}, nullptr, nullptr, arr.d, arr.sd};
  g.hw_info = hw;
  g.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::AlongM;
  g.epilogue.thread.alpha = 1.0f;
  g.epilogue.thread.beta = 0.0f;
  return g;
}

template <class C>
size_t ScratchBytes(const GroupedGemmArgs& args, int sms) {
  const Arrays<C> fake = Arrays<C>::Carve(nullptr, args);
  return Arrays<C>::ArraysBytes(args) +
         C::Gemm::get_workspace_size(MakeArguments<C>(args, fake, sms));
}

template <class C, GgKind kKind>
const char* Run(const GroupedGemmArgs& args, void* scratch, int sms, cudaStream_t stream) {
  const Arrays<C> arr = Arrays<C>::Carve(scratch, args);
  PrepGroups<C, kKind><<<1, kPrepThreads, 0, stream>>>(args, arr);
  if (cudaGetLastError() != cudaSuccess) return "prep kernel launch failed";
  constexpr int kZeroThreads = 256;
  if constexpr (kKind == GgKind::kWeightGrad || kKind == GgKind::kWeightGradFp8) {
    const int64_t group_vecs = args.h * args.f * int64_t(sizeof(typename C::D)) / 16;
    dim3 grid(64, args.num_groups);
    ZeroEmptyGroups<<<grid, kZeroThreads, 0, stream>>>(static_cast<uint4*>(args.out), group_vecs,
                                                     arr.sizes);
  } else if (args.group_stride == 0) {
    const int64_t width = kKind == GgKind::kTransW ? args.h : args.f;
    const int64_t row_vecs = width * int64_t(sizeof(typename C::D)) / 16;
    ZeroTailRows<<<2 * sms, kZeroThreads, 0, stream>>>(static_cast<uint4*>(args.out), row_vecs,
                                                      args.rows, arr.total);
  }
  if (cudaGetLastError() != cudaSuccess) return "zero-fill kernel launch failed";
  typename C::Gemm gemm;
  const auto g = MakeArguments<C>(args, arr, sms);
  if (gemm.initialize(g, arr.workspace, stream) != cutlass::Status::kSuccess) {
    return "CUTLASS grouped GEMM initialize failed";
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) return "CUTLASS grouped GEMM launch failed";
  return nullptr;
}

}  // namespace jax_ep::gg
