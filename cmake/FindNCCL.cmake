# Finds NCCL (headers with the device API, and libnccl.so.2): NCCL_ROOT, the
# nvidia-nccl-cu13 / -cu12 pip wheel of the building Python, then the system.
# Defines NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_LIBRARY_DIR,
# NCCL_VERSION, NCCL_WHEEL and the imported target NCCL::NCCL.
set(_nccl_hints "")
if(NCCL_ROOT)
  list(APPEND _nccl_hints "${NCCL_ROOT}")
endif()
if(DEFINED ENV{NCCL_ROOT})
  list(APPEND _nccl_hints "$ENV{NCCL_ROOT}")
endif()
if(Python_EXECUTABLE)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import nvidia.nccl as m, os; print(os.path.dirname(m.__file__) if m.__file__ else list(m.__path__)[0])"
    OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE _nccl_wheel
    RESULT_VARIABLE _nccl_rc ERROR_QUIET)
  if(_nccl_rc EQUAL 0 AND _nccl_wheel)
    list(APPEND _nccl_hints "${_nccl_wheel}")
  endif()
endif()

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include
          PATHS /usr /usr/local /usr/local/cuda)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints}
             PATH_SUFFIXES lib lib64 PATHS /usr /usr/local /usr/local/cuda
             /usr/lib/x86_64-linux-gnu)

if(NCCL_INCLUDE_DIR AND NOT EXISTS "${NCCL_INCLUDE_DIR}/nccl_device.h")
  message(STATUS "jax_ep: NCCL at ${NCCL_INCLUDE_DIR} has no device API (nccl_device.h); need >= 2.28")
  set(NCCL_INCLUDE_DIR NCCL_INCLUDE_DIR-NOTFOUND)
endif()

if(NCCL_INCLUDE_DIR)
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_ver REGEX "#define NCCL_(MAJOR|MINOR|PATCH) ")
  string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*" "\\1" _maj "${_nccl_ver}")
  string(REGEX REPLACE ".*NCCL_MINOR ([0-9]+).*" "\\1" _min "${_nccl_ver}")
  string(REGEX REPLACE ".*NCCL_PATCH ([0-9]+).*" "\\1" _pat "${_nccl_ver}")
  set(NCCL_VERSION "${_maj}.${_min}.${_pat}")
  # Which pip wheel the headers came from (nvidia-nccl-cu12 or -cu13: the
  # same version number, built for different CUDA majors); empty otherwise.
  file(GLOB _nccl_dists "${NCCL_INCLUDE_DIR}/../../../nvidia_nccl_cu*.dist-info")
  set(NCCL_WHEEL "")
  foreach(_d IN LISTS _nccl_dists)
    get_filename_component(_d "${_d}" NAME)
    string(REGEX REPLACE "^nvidia_nccl_(cu[0-9]+)-.*" "nvidia-nccl-\\1" _d "${_d}")
    list(APPEND NCCL_WHEEL "${_d}")
  endforeach()
  list(JOIN NCCL_WHEEL "," NCCL_WHEEL)
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_INCLUDE_DIR NCCL_LIBRARY
                                  VERSION_VAR NCCL_VERSION)
if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  get_filename_component(NCCL_LIBRARY_DIR "${NCCL_LIBRARY}" DIRECTORY)
  add_library(NCCL::NCCL SHARED IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
