// Probe (GPU, SM90): CUTLASS's blockwise-scaled FP8 GEMM, one configuration per build, with a
// C entry point for ctypes. Used by scripts/probe_cutlass_blockwise.py to time CUTLASS's
// cooperative and ping-pong kernels against cuBLAS (torch's scaled_mm) on the grouped step's
// GEMMs; not part of the package.
//
//   D[m, n] = sum_k A[m, k] * B[n, k] * sfa[m / GM, k / 128] * sfb[n / GN, k / 128]
//
// A and B K-major FP8 (E4M3, or E5M2 for A), D row-major BF16, scales FP32 and M/N-major: sfa at
// (m / GM) + (k / 128) * ceil(M / GM), the layout torch's scaled_mm takes for 1x128 operands.
// Build-time macros: MFP8_NAME (the exported symbol), MFP8_TILE_M / _N, MFP8_CLUSTER_M / _N,
// MFP8_PINGPONG (0: cooperative), MFP8_GN (B's scale granularity along N: 1 or 128),
// MFP8_A_E5M2 (A in E5M2).

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

namespace {

#if MFP8_A_E5M2
using ElementA = cutlass::float_e5m2_t;
#else
using ElementA = cutlass::float_e4m3_t;
#endif
using ElementB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using Accum = float;

using Tile = Shape<Int<MFP8_TILE_M>, Int<MFP8_TILE_N>, _128>;
using Cluster = Shape<Int<MFP8_CLUSTER_M>, Int<MFP8_CLUSTER_N>, _1>;
using Scales = cutlass::detail::Sm90BlockwiseScaleConfig<1, MFP8_GN, 128>;
using LayoutSFA = decltype(Scales::deduce_layoutSFA());
using LayoutSFB = decltype(Scales::deduce_layoutSFB());

#if MFP8_PINGPONG
using MainSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8BlockScaledAccum;
using EpiSchedule = cutlass::epilogue::TmaWarpSpecialized;
#else
using MainSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
using EpiSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#endif

constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, Accum, Accum,
    void, cutlass::layout::RowMajor, kAlignD,
    ElementD, cutlass::layout::RowMajor, kAlignD,
    EpiSchedule,
    cutlass::epilogue::fusion::LinearCombination<ElementD, Accum, void, Accum>>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, cute::tuple<cutlass::layout::RowMajor, LayoutSFA>, 16,
    ElementB, cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, 16,
    Accum, Tile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    MainSchedule>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

int sm_count() {
  static int count = 0;
  if (count == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(dev);
  }
  return count;
}

}  // namespace

// 0 on success; 1: cannot implement; 2: initialize failed; 3: run failed; 4: needs a workspace.
extern "C" int MFP8_NAME(const void* a, const void* b, const float* sfa, const float* sfb, void* d,
                         int m, int n, int k, void* stream) {
  auto sa = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(m, k, 1));
  auto sb = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(n, k, 1));
  auto sd = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(m, n, 1));
  auto lsfa = Scales::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
  auto lsfb = Scales::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
  cutlass::KernelHardwareInfo hw;
  hw.sm_count = sm_count();
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const ElementA*>(a), sa, static_cast<const ElementB*>(b), sb, sfa, lsfa, sfb, lsfb},
      {{}, nullptr, sd, static_cast<ElementD*>(d), sd},
      hw};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (Gemm::get_workspace_size(args) != 0) return 4;
  auto s = static_cast<cudaStream_t>(stream);
  if (gemm.initialize(args, nullptr, s) != cutlass::Status::kSuccess) return 2;
  return gemm.run(s) == cutlass::Status::kSuccess ? 0 : 3;
}
