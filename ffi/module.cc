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
}
