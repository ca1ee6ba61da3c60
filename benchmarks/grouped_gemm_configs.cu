// Probe: the grouped forward (x[rows_g, H] @ w[g], docs/design.md §6's shape) under
// several CUTLASS schedules and weight layouts, each in its own binary
// (-DCFG=n), timed with CUDA events on uniform 256-row groups and on routed
// group sizes, each with both tile orders. It reuses the package's prep
// kernel and argument builder (kernels/grouped_gemm.cuh), so what it times is
// what the op would launch with that schedule. Checks sampled outputs against
// a plain dot product before timing. CFG 10-17: the other bf16 products and
// the FP8 forward; CFG 20-25: FP8 weight-gradient schedules at the EP1 routed
// shape (256 groups of ~128 tokens), each with a sampled value check.
//
//   nvcc -std=c++17 -O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -DCFG=0 \
//     -I ffi -I $CUTLASS/include -I $CUTLASS/tools/util/include \
//     benchmarks/grouped_gemm_configs.cu -o /tmp/ggc0
//   then run each binary on the GPU machine (benchmarks/RESULTS.md, session 6,
//   device runs 2-3, has the loop and the results).
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels/grouped_gemm.cuh"
#include "probe_routing.h"
#include "probe_timing.h"

namespace {
using namespace jax_ep;
using Row = cutlass::layout::RowMajor;
using Col = cutlass::layout::ColumnMajor;
using Bf16 = cutlass::bfloat16_t;
using cute::_1;
using cute::_2;
using cute::_64;
using cute::_128;
using cute::_256;

template <class M, class N, class K, class CM, class CN, bool kPingpong = false>
struct Sched {
  using Tile = cute::Shape<M, N, K>;
  using Cluster = cute::Shape<CM, CN, _1>;
  using Kernel = std::conditional_t<kPingpong,
                                    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using Epi = std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

#if CFG == 0
using LB = Row; using LD = Row;
using S = Sched<_128, _256, _64, _1, _2>;
const char* kName = "coop 128x256x64 c1x2 B N-major (current)";
#elif CFG == 1
using LB = Col; using LD = Row;
using S = Sched<_128, _256, _64, _1, _2>;
const char* kName = "coop 128x256x64 c1x2 B K-major";
#elif CFG == 2
using LB = Col; using LD = Row;
using S = Sched<_256, _128, _64, _1, _2>;
const char* kName = "coop 256x128x64 c1x2 B K-major";
#elif CFG == 3
using LB = Col; using LD = Col;
using S = Sched<_256, _128, _128, _1, _2>;
const char* kName = "coop 256x128x128 c1x2 B K-major D col (example 57)";
#elif CFG == 4
using LB = Row; using LD = Row;
using S = Sched<_128, _256, _64, _2, _1>;
const char* kName = "coop 128x256x64 c2x1 B N-major";
#elif CFG == 5
using LB = Row; using LD = Row;
using S = Sched<_128, _128, _64, _1, _2, true>;
const char* kName = "pingpong 128x128x64 c1x2 B N-major";
#elif CFG == 6
using LB = Row; using LD = Row;
using S = Sched<_128, _256, _64, _1, _1>;
const char* kName = "coop 128x256x64 c1x1 B N-major";
#elif CFG == 7
using LB = Col; using LD = Row;
using S = Sched<_128, _128, _64, _1, _2, true>;
const char* kName = "pingpong 128x128x64 c1x2 B K-major";
#elif CFG >= 10
// Other products, timed through gg::Run (tile order along M), no check.
using LB = Row; using LD = Row;
using S = Sched<_128, _256, _64, _1, _2>;
const char* kName = "";
#elif CFG == 8
using LB = Row; using LD = Row;
using S = Sched<_128, _128, _64, _1, _2>;
const char* kName = "coop 128x128x64 c1x2 B N-major";
#elif CFG == 9
using LB = Row; using LD = Row;
using S = Sched<_128, _256, _64, _1, cute::_4>;
const char* kName = "coop 128x256x64 c1x4 B N-major";
#endif

using C = gg::Config<Row, LB, Bf16, S, LD>;

template <class Sc>
struct Fp8Of : gg::GemmOf<Sc, cutlass::float_e4m3_t,
                          cute::tuple<Row*, gg::Fp8Scales::LayoutSFA*>,
                          cute::tuple<Col*, gg::Fp8Scales::LayoutSFB*>, Bf16, Row> {
  static constexpr bool kBlockScaled = true;
  using LayoutSFA = gg::Fp8Scales::LayoutSFA;
  using LayoutSFB = gg::Fp8Scales::LayoutSFB;
};
template <class Sc>
using TransWOf = gg::Config<Row, Col, Bf16, Sc>;
template <class Sc>
using WGradOf = gg::Config<Col, Row, Bf16, Sc>;
template <class M, class N, class K, class CM, class CN>
struct Fp8Sched {
  using Tile = cute::Shape<M, N, K>;
  using Cluster = cute::Shape<CM, CN, _1>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using Epi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
#if CFG == 10
using Other = TransWOf<Sched<_128, _256, _64, _1, _2>>; constexpr GgKind kOther = GgKind::kTransW;
const char* kOtherName = "dx coop 128x256x64 c1x2 (current)";
#elif CFG == 11
using Other = TransWOf<Sched<_128, _256, _64, _1, _1>>; constexpr GgKind kOther = GgKind::kTransW;
const char* kOtherName = "dx coop 128x256x64 c1x1";
#elif CFG == 12
using Other = WGradOf<Sched<_128, _256, _64, _1, _2>>; constexpr GgKind kOther = GgKind::kWeightGrad;
const char* kOtherName = "dw coop 128x256x64 c1x2 (current)";
#elif CFG == 13
using Other = WGradOf<Sched<_128, _256, _64, _1, _1>>; constexpr GgKind kOther = GgKind::kWeightGrad;
const char* kOtherName = "dw coop 128x256x64 c1x1";
#elif CFG == 14
using Other = Fp8Of<Fp8Sched<_128, _128, _128, _1, _2>>; constexpr GgKind kOther = GgKind::kForwardFp8;
const char* kOtherName = "fp8 128x128x128 c1x2";
#elif CFG == 15
using Other = Fp8Of<Fp8Sched<_128, _128, _128, _1, _1>>; constexpr GgKind kOther = GgKind::kForwardFp8;
const char* kOtherName = "fp8 128x128x128 c1x1 (current)";
#elif CFG == 16
// (N = 256 tiles do not build with 128-wide scale blocks along N in CUTLASS
// 4.2: "Accumulator and scaleB must have same shape".)
using Other = Fp8Of<Fp8Sched<_256, _128, _128, _1, _1>>; constexpr GgKind kOther = GgKind::kForwardFp8;
const char* kOtherName = "fp8 256x128x128 c1x1";
#elif CFG == 17
using Other = Fp8Of<Fp8Sched<_128, _128, _128, _2, _1>>; constexpr GgKind kOther = GgKind::kForwardFp8;
const char* kOtherName = "fp8 128x128x128 c2x1";
#elif CFG >= 20
// FP8 weight gradient (kWeightGradFp8) schedules, timed by RunWgradFp8.
template <class M, class N, class K, bool kPingpong>
struct WgradSched {
  using Tile = cute::Shape<M, N, K>;
  using Cluster = cute::Shape<_1, _1, _1>;
  using Kernel = std::conditional_t<
      kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>;
  using Epi = std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};
template <class Sc>
struct WgradFp8Of : gg::GemmOf<Sc, cutlass::float_e4m3_t,
                               cute::tuple<Row*, gg::Fp8WgradScales::LayoutSFA*>,
                               cute::tuple<Col*, gg::Fp8WgradScales::LayoutSFB*>, Bf16, Row> {
  static constexpr bool kBlockScaled = true;
  using LayoutSFA = gg::Fp8WgradScales::LayoutSFA;
  using LayoutSFB = gg::Fp8WgradScales::LayoutSFB;
};
#if CFG == 20
using Wg = gg::Fp8WgradConfig;
const char* kWgName = "fp8 dw coop 128x128x128 (current)";
#elif CFG == 21
using Wg = WgradFp8Of<WgradSched<_128, _256, _128, false>>;
const char* kWgName = "fp8 dw coop 128x256x128";
#elif CFG == 22
using Wg = WgradFp8Of<WgradSched<_256, _128, _128, false>>;
const char* kWgName = "fp8 dw coop 256x128x128";
#elif CFG == 23
using Wg = WgradFp8Of<WgradSched<_64, _128, _128, true>>;
const char* kWgName = "fp8 dw pingpong 64x128x128";
#elif CFG == 24
using Wg = WgradFp8Of<WgradSched<_64, _256, _128, true>>;
const char* kWgName = "fp8 dw pingpong 64x256x128";
#elif CFG == 25
using Wg = WgradFp8Of<WgradSched<_128, _128, _128, true>>;
const char* kWgName = "fp8 dw pingpong 128x128x128";
#endif
#endif
constexpr bool kBKMajor = std::is_same_v<LB, Col>;
constexpr bool kDColMajor = std::is_same_v<LD, Col>;

__global__ void Fill(Bf16* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = Bf16((float(h & 0xffff) / 65535.f - 0.5f) * scale);
  }
}

// out[r, n] by a plain dot product, for sampled (r, g, start, n).
__global__ void Check(const Bf16* x, const Bf16* w, const Bf16* out, const int4* samples, int n_s,
                      int64_t H, int64_t F, float* err) {
  const int i = blockIdx.x;
  if (i >= n_s) return;
  const int4 s = samples[i];  // row, group, start, col
  float acc = 0.f;
  for (int64_t k = threadIdx.x; k < H; k += blockDim.x) {
    const float b = kBKMajor ? float(w[s.y * H * F + int64_t(s.w) * H + k])
                             : float(w[s.y * H * F + k * F + s.w]);
    acc += float(x[int64_t(s.x) * H + k]) * b;
  }
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ float part[32];
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.f;
    for (int j = 0; j < blockDim.x / 32; ++j) t += part[j];
    const int64_t m = s.x - s.z;  // row within the group
    // A column-major D has the group's row count as leading dimension: the
    // host passes it in err[i], which this thread then overwrites.
    const float got = kDColMajor ? float(out[int64_t(s.z) * F + int64_t(s.w) * int64_t(err[i]) + m])
                                 : float(out[int64_t(s.x) * F + s.w]);
    err[i] = fabsf(got - t) / (fabsf(t) + 1e-2f);
  }
}

__global__ void FillF32(float* p, int64_t n, float v) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    p[i] = v * (1.f + 0.001f * float(i % 7));
  }
}

// One grouped product as the op launches it (prep, fills, kernel through
// gg::Run): scratch sized for `args`, one launch, then the median of
// `calls`-launch batches; a refused launch ends the probe.
template <class G, GgKind kKind>
float TimeRun(const GroupedGemmArgs& args, int sms, cudaStream_t st, int warmup, int calls) {
  void* scratch;
  CK(cudaMalloc(&scratch, gg::ScratchBytes<G>(args, sms) + 256));
  auto launch = [&]() {
    if (const char* e = gg::Run<G, kKind>(args, scratch, sms, st)) {
      std::printf("run failed: %s\n", e);
      std::exit(1);
    }
  };
  launch();
  CK(cudaStreamSynchronize(st));
  const float ms = MedianMs(launch, st, warmup, calls);
  cudaFree(scratch);
  return ms;
}

#if CFG >= 20
// The FP8 weight gradient at the EP1 shape of docs/design.md §6: E_l = 256
// experts, T*K = 32768 routed rows, so each group has ~128 tokens: K is one
// or two 128-token chunks and the [H, F] bf16 output per group dominates the
// bytes. Both products of a SwiGLU layer: dw13 [7168, 4096] and dw2
// [2048, 7168]. Operands are filler bytes (timing only); the GPU test suite
// checks the schedule the op ships.
int RunWgradFp8(int sms, cudaStream_t st) {
  constexpr int kGroups = 256, kRows = 32768;
  std::printf("%s\n", kWgName);
  std::mt19937 rng(11);
  std::vector<int> routed(kGroups, 0);
  for (int i = 0; i < kRows; ++i) routed[rng() % kGroups]++;
  std::vector<int> padded(kGroups);
  int p = 0;
  for (int g = 0; g < kGroups; ++g) p += padded[g] = (routed[g] + 127) / 128 * 128;
  const int64_t shapes[2][2] = {{7168, 4096}, {2048, 7168}};
  for (const auto& hf : shapes) {
    const int64_t H = hf[0], F = hf[1];
    uint8_t *a, *b;
    float *as, *bs;
    Bf16* out;
    int32_t* sizes_d;
    CK(cudaMalloc(&a, H * p));
    CK(cudaMalloc(&b, F * p));
    CK(cudaMalloc(&as, sizeof(float) * (p / 128) * H));
    CK(cudaMalloc(&bs, sizeof(float) * (p / 128) * F));
    CK(cudaMalloc(&out, sizeof(Bf16) * kGroups * H * F));
    CK(cudaMalloc(&sizes_d, sizeof(int32_t) * kGroups));
    CK(cudaMemsetAsync(a, 0x38, H * p, st));  // e4m3 1.0
    CK(cudaMemsetAsync(b, 0x30, F * p, st));  // e4m3 0.5
    FillF32<<<256, 256, 0, st>>>(as, (p / 128) * H, 1.f / 64);
    FillF32<<<256, 256, 0, st>>>(bs, (p / 128) * F, 1.f / 256);
    CK(cudaMemcpyAsync(sizes_d, routed.data(), sizeof(int32_t) * kGroups, cudaMemcpyHostToDevice,
                       st));
    GroupedGemmArgs args;
    args.kind = GgKind::kWeightGradFp8;
    args.group_sizes = sizes_d;
    args.num_groups = kGroups;
    args.rows = p;
    args.h = H;
    args.f = F;
    args.out = out;
    args.a = a;
    args.b = b;
    args.a_scales = as;
    args.b_scales = bs;
    const float ms = TimeRun<Wg, GgKind::kWeightGradFp8>(args, sms, st, 2, 3);
    // Every product is K * 1.0 * 0.5 * (1/64) * (1/256) (scales up to 0.6 %
    // apart): a sampled output far from that means a broken schedule.
    Bf16 probe[4];
    CK(cudaMemcpy(probe, out + (kGroups / 2) * H * F + 5 * F + 3, sizeof(probe),
                  cudaMemcpyDeviceToHost));
    const float want = padded[kGroups / 2] * 0.5f / 64.f / 256.f;
    const double out_bytes = double(kGroups) * H * F * sizeof(Bf16);
    std::printf("  H %5lld F %5lld  padded tokens %6d  %.3f ms  %6.1f TFLOP/s (padded)  "
                "%5.2f TB/s of output  sample %.4g (want ~%.4g)%s\n",
                (long long)H, (long long)F, p, ms, 2.0 * p * H * F / (ms * 1e-3) / 1e12,
                out_bytes / (ms * 1e-3) / 1e12, float(probe[0]), want,
                fabsf(float(probe[0]) - want) < 0.02f * want ? "" : "  WRONG");
    cudaFree(a);
    cudaFree(b);
    cudaFree(as);
    cudaFree(bs);
    cudaFree(out);
    cudaFree(sizes_d);
  }
  return 0;
}
#elif CFG >= 10
// The FP8 forward at the fused MoE's linear 1 at EP1 (docs/mega_moe.md): 4096
// tokens to top-8 of 256 experts (~128 rows each, aligned to 8 as the op
// does), w13 [256, 7168, 4096] e4m3 (7.5 GB), so each expert's weights are
// read once per M tile. mega_linear1_probe times the same shape.
void RunLinear1Ep1(Bf16* x, Bf16* out, int sms, cudaStream_t st) {
  constexpr int64_t H = 7168, N = 4096;
  constexpr int kGroups = 256, kTokens = 4096, kTopk = 8;
  std::mt19937 rng(5);
  std::vector<int> sizes;
  int rows = 0;
  for (const auto& tokens : TopkTokensByExpert(kTokens, kTopk, kGroups, rng)) {
    sizes.push_back((int(tokens.size()) + 7) / 8 * 8);
    rows += sizes.back();
  }
  uint8_t* w8;
  float *xs, *ws;
  int32_t* sizes_d;
  CK(cudaMalloc(&w8, kGroups * H * N));
  CK(cudaMalloc(&xs, sizeof(float) * rows * (H / 128)));
  CK(cudaMalloc(&ws, sizeof(float) * kGroups * (H / 128) * (N / 128)));
  CK(cudaMalloc(&sizes_d, sizeof(int32_t) * kGroups));
  // bf16 bytes read as e4m3, as the other patterns do.
  Fill<<<1024, 256, 0, st>>>(reinterpret_cast<Bf16*>(w8), kGroups * H * N / 2, 3u, 0.05f);
  FillF32<<<256, 256, 0, st>>>(xs, rows * (H / 128), 1.f / 64);
  FillF32<<<256, 256, 0, st>>>(ws, kGroups * (H / 128) * (N / 128), 1.f / 256);
  CK(cudaMemcpyAsync(sizes_d, sizes.data(), sizeof(int32_t) * kGroups, cudaMemcpyHostToDevice,
                     st));
  GroupedGemmArgs args;
  args.kind = GgKind::kForwardFp8;
  args.a = x;
  args.b = w8;
  args.a_scales = xs;
  args.b_scales = ws;
  args.out = out;
  args.group_sizes = sizes_d;
  args.num_groups = kGroups;
  args.rows = rows;
  args.h = H;
  args.f = N;
  const float ms = TimeRun<Other, kOther>(args, sms, st, 2, 5);
  std::printf("  linear 1 at EP1 (256 groups, rows %d, N %lld)  %.3f ms  %6.1f TFLOP/s  "
              "weights %.2f TB/s\n", rows, static_cast<long long>(N), ms,
              2.0 * rows * H * N / (ms * 1e-3) / 1e12, double(kGroups) * H * N / (ms * 1e-3) / 1e12);
  cudaFree(w8);
  cudaFree(xs);
  cudaFree(ws);
  cudaFree(sizes_d);
}

// dx, dw and FP8 forward through gg::Run: prep, fills and the grouped kernel,
// as the op launches them. Operands reuse the bf16 buffers (FP8 reads their
// bytes as e4m3; the odd NaN code among them does not change the timing).
int RunOther(Bf16* x, Bf16* w, Bf16* out, int32_t* sizes_d, const std::vector<int>& uniform,
             const std::vector<int>& routed, int sms, cudaStream_t st) {
  constexpr int64_t H = 7168, F = 2048;
  constexpr int kGroups = 128, kRows = 32768;
  std::printf("%s\n", kOtherName);
  float *xs = nullptr, *ws = nullptr;
  if constexpr (kOther == GgKind::kForwardFp8) {
    CK(cudaMalloc(&xs, sizeof(float) * 40000 * (H / 128)));
    CK(cudaMalloc(&ws, sizeof(float) * kGroups * (H / 128) * (F / 128)));
    FillF32<<<256, 256, 0, st>>>(xs, 40000 * (H / 128), 1.f / 64);
    FillF32<<<256, 256, 0, st>>>(ws, kGroups * (H / 128) * (F / 128), 1.f / 256);
  }
  for (int pattern = 0; pattern < 2; ++pattern) {
    const std::vector<int>& sz = pattern == 0 ? uniform : routed;
    int rows = 0;
    for (int s : sz) rows += s;
    CK(cudaMemcpyAsync(sizes_d, sz.data(), sizeof(int32_t) * kGroups, cudaMemcpyHostToDevice, st));
    GroupedGemmArgs args;
    args.kind = kOther;
    args.group_sizes = sizes_d;
    args.num_groups = kGroups;
    args.rows = rows;
    args.h = H;
    args.f = F;
    args.out = out;
    if constexpr (kOther == GgKind::kTransW) {
      args.a = x;  // dy [rows, F]
      args.b = w;
    } else if constexpr (kOther == GgKind::kWeightGrad) {
      args.a = x;  // x [rows, H]
      args.b = w;  // dy [rows, F]
    } else {
      args.a = x;
      args.b = w;
      args.a_scales = xs;
      args.b_scales = ws;
    }
    const float ms = TimeRun<Other, kOther>(args, sms, st, 3, 10);
    std::printf("  %-8s rows %6d  %.3f ms  %6.1f TFLOP/s (useful)\n",
                pattern == 0 ? "uniform" : "routed", rows, ms, 2.0 * kRows * H * F / (ms * 1e-3) / 1e12);
  }
  if constexpr (kOther == GgKind::kForwardFp8) RunLinear1Ep1(x, out, sms, st);
  return 0;
}
#endif

}  // namespace

int main() {
  constexpr int kGroups = 128, kRows = 32768, kAlign = 8;
  constexpr int64_t H = 7168, F = 2048;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));

  std::mt19937 rng(7);
  std::vector<int> routed(kGroups, 0);
  for (int i = 0; i < kRows; ++i) routed[rng() % kGroups]++;
  for (int& s : routed) s = (s + kAlign - 1) / kAlign * kAlign;
  std::vector<int> uniform(kGroups, kRows / kGroups);
  int max_rows = 0;
  for (int s : routed) max_rows += s;
  max_rows = std::max(max_rows, kRows);

  Bf16 *x, *w, *out;
  int32_t* sizes_d;
  CK(cudaMalloc(&x, sizeof(Bf16) * max_rows * H));
  CK(cudaMalloc(&w, sizeof(Bf16) * kGroups * H * F));
  // Large enough for every product's output: [rows, H] (dx) and [G, H, F] (dw).
  CK(cudaMalloc(&out, sizeof(Bf16) * kGroups * H * F));
  CK(cudaMalloc(&sizes_d, sizeof(int32_t) * kGroups));
  Fill<<<1024, 256, 0, st>>>(x, int64_t(max_rows) * H, 1u, 2.f);
  Fill<<<1024, 256, 0, st>>>(w, int64_t(kGroups) * H * F, 2u, 0.05f);

#if CFG >= 20
  return RunWgradFp8(sms, st);
#elif CFG >= 10
  return RunOther(x, w, out, sizes_d, uniform, routed, sms, st);
#endif
  std::printf("%s\n", kName);
  for (int pattern = 0; pattern < 2; ++pattern) {
    const std::vector<int>& sz = pattern == 0 ? uniform : routed;
    int rows = 0;
    for (int s : sz) rows += s;
    CK(cudaMemcpyAsync(sizes_d, sz.data(), sizeof(int32_t) * kGroups, cudaMemcpyHostToDevice, st));
    GroupedGemmArgs args;
    args.kind = GgKind::kForward;
    args.a = x;
    args.b = w;
    args.out = out;
    args.group_sizes = sizes_d;
    args.num_groups = kGroups;
    args.rows = rows;
    args.h = H;
    args.f = F;
    const size_t bytes = gg::ScratchBytes<C>(args, sms);
    void* scratch;
    CK(cudaMalloc(&scratch, bytes + 256));
    const auto arr = gg::Arrays<C>::Carve(scratch, args);
    for (int raster = 0; raster < 2; ++raster) {
      const auto order = raster == 0 ? cutlass::gemm::kernel::detail::RasterOrderOptions::AlongM
                                     : cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN;
      auto launch = [&]() {
        gg::PrepGroups<C, GgKind::kForward><<<1, gg::kPrepThreads, 0, st>>>(args, arr);
        typename C::Gemm gemm;
        auto g = gg::MakeArguments<C>(args, arr, sms);
        g.scheduler.raster_order = order;
        if (gemm.initialize(g, arr.workspace, st) != cutlass::Status::kSuccess) {
          std::printf("initialize failed\n");
          std::exit(1);
        }
        if (gemm.run(st) != cutlass::Status::kSuccess) {
          std::printf("run failed\n");
          std::exit(1);
        }
      };
      CK(cudaMemsetAsync(out, 0, sizeof(Bf16) * rows * F, st));
      launch();
      CK(cudaStreamSynchronize(st));
      // Sampled check: 64 (row, col) pairs across groups.
      std::vector<int4> samples;
      std::vector<float> lds;
      int start = 0;
      for (int g = 0; g < kGroups; ++g) {
        if (g % 2 == 0 && sz[g] > 0) {
          const int r = start + int(rng() % sz[g]);
          samples.push_back(make_int4(r, g, start, int(rng() % F)));
          lds.push_back(float(sz[g]));
        }
        start += sz[g];
      }
      int4* samples_d;
      float* err_d;
      CK(cudaMalloc(&samples_d, sizeof(int4) * samples.size()));
      CK(cudaMalloc(&err_d, sizeof(float) * samples.size()));
      CK(cudaMemcpy(samples_d, samples.data(), sizeof(int4) * samples.size(), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(err_d, lds.data(), sizeof(float) * lds.size(), cudaMemcpyHostToDevice));
      Check<<<int(samples.size()), 256, 0, st>>>(x, w, out, samples_d, int(samples.size()), H, F,
                                                 err_d);
      std::vector<float> err(samples.size());
      CK(cudaMemcpy(err.data(), err_d, sizeof(float) * err.size(), cudaMemcpyDeviceToHost));
      const float worst = *std::max_element(err.begin(), err.end());
      cudaFree(samples_d);
      cudaFree(err_d);

      const float ms = MedianMs(launch, st, 3, 10);
      const double tflops = 2.0 * kRows * H * F / (ms * 1e-3) / 1e12;
      std::printf("  %-8s raster %-6s rows %6d  %.3f ms  %6.1f TFLOP/s (useful)  max rel err %.2e%s\n",
                  pattern == 0 ? "uniform" : "routed", raster == 0 ? "AlongM" : "AlongN", rows, ms,
                  tflops, worst, worst < 2e-2f ? "" : "  WRONG");
    }
    cudaFree(scratch);
  }
  return 0;
}
