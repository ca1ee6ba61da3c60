// nanobind module jax_ep._jax_ep: the one place where Python meets C++.
// Without CUDA it only reports that; with CUDA it also exposes the FFI
// handler capsules and the communicator lifetime (see comm.h).
#include <nanobind/nanobind.h>

namespace nb = nanobind;

#ifdef JAX_EP_WITH_CUDA
void RegisterCudaBindings(nb::module_& m);  // defined in handlers/bindings.cc
#endif

NB_MODULE(_jax_ep, m) {
#ifdef JAX_EP_WITH_CUDA
  m.attr("cuda_built") = true;
  RegisterCudaBindings(m);
#else
  m.attr("cuda_built") = false;
#endif
  // The test harness (ffi/testing/: virtual ranks, the probe, device timers),
  // built with JAX_EP_TESTING=ON only.
#if defined(JAX_EP_WITH_CUDA) && defined(JAX_EP_TESTING)
  m.attr("testing_built") = true;
#else
  m.attr("testing_built") = false;
#endif
  // What CMake found when this module was built (CMakeLists.txt).
  nb::dict info;
  info["cuda_built"] = m.attr("cuda_built");
  info["testing_built"] = m.attr("testing_built");
  info["why_not_cuda"] = JAX_EP_BUILD_REASON;
  info["jaxlib_at_build"] = JAX_EP_BUILD_JAXLIB;
  info["cuda_toolkit"] = JAX_EP_BUILD_CUDA;
  info["cuda_archs"] = JAX_EP_BUILD_ARCHS;
  info["nccl_headers"] = JAX_EP_BUILD_NCCL;
  info["nccl_wheel"] = JAX_EP_BUILD_NCCL_WHEEL;  // nvidia-nccl-cu12 / -cu13, or ""
  info["cutlass_headers"] = JAX_EP_BUILD_CUTLASS;
  // The debugging / comparison build options (CMakeLists.txt).
  info["bulk_copies"] = static_cast<bool>(JAX_EP_BUILD_BULK_COPIES);
  info["setup_stamps"] = static_cast<bool>(JAX_EP_BUILD_SETUP_STAMPS);
  m.attr("build_info") = info;
}
