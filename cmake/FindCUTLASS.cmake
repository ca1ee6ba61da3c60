# CUTLASS C++ headers from the pinned `nvidia-cutlass` wheel (its
# cutlass_library package carries include/ and tools/util/include/), or from
# CUTLASS_DIR. Sets CUTLASS_FOUND, CUTLASS_INCLUDE_DIRS, CUTLASS_VERSION.
if(NOT CUTLASS_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(s.submodule_search_locations[0], 'source') if s else '')"
    OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE CUTLASS_DIR ERROR_QUIET)
endif()
set(CUTLASS_FOUND FALSE)
if(CUTLASS_DIR AND EXISTS "${CUTLASS_DIR}/include/cutlass/version.h")
  set(CUTLASS_FOUND TRUE)
  set(CUTLASS_INCLUDE_DIRS "${CUTLASS_DIR}/include" "${CUTLASS_DIR}/tools/util/include")
  file(STRINGS "${CUTLASS_DIR}/include/cutlass/version.h" _cutlass_v
       REGEX "#define CUTLASS_(MAJOR|MINOR|PATCH) [0-9]+")
  string(REGEX REPLACE ".*MAJOR ([0-9]+).*MINOR ([0-9]+).*PATCH ([0-9]+).*" "\\1.\\2.\\3"
         CUTLASS_VERSION "${_cutlass_v}")
endif()
