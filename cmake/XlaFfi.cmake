# XLA FFI headers ship inside jaxlib (jax.ffi.include_dir() points there).
if(NOT XLA_FFI_INCLUDE_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import os, jaxlib; print(os.path.join(os.path.dirname(jaxlib.__file__), 'include'))"
    OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE XLA_FFI_INCLUDE_DIR
    RESULT_VARIABLE _xla_ffi_rc)
endif()
if(NOT EXISTS "${XLA_FFI_INCLUDE_DIR}/xla/ffi/api/ffi.h")
  message(FATAL_ERROR "XLA FFI headers not found under '${XLA_FFI_INCLUDE_DIR}' (is jaxlib installed?)")
endif()
message(STATUS "jax_ep: XLA FFI headers at ${XLA_FFI_INCLUDE_DIR}")
