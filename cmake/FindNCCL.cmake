# Finds NCCL (shipped with the CUDA toolkit here, or installed on its own).
#   NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, NCCL_VERSION, imported target NCCL::nccl
include("${CMAKE_CURRENT_LIST_DIR}/PulselocoCudaToolkit.cmake")
if(NOT CUDAToolkit_FOUND)
  pulseloco_find_cuda_toolkit(QUIET)
endif()
find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ENV NCCL_HOME ENV NCCL_ROOT ${CUDAToolkit_INCLUDE_DIRS}
  PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl
  HINTS ENV NCCL_HOME ENV NCCL_ROOT ${CUDAToolkit_LIBRARY_DIR}
  PATH_SUFFIXES lib lib64)
if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_major REGEX "^#define NCCL_MAJOR +[0-9]+")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_minor REGEX "^#define NCCL_MINOR +[0-9]+")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_patch REGEX "^#define NCCL_PATCH +[0-9]+")
  string(REGEX MATCH "[0-9]+$" _nccl_major "${_nccl_major}")
  string(REGEX MATCH "[0-9]+$" _nccl_minor "${_nccl_minor}")
  string(REGEX MATCH "[0-9]+$" _nccl_patch "${_nccl_patch}")
  set(NCCL_VERSION "${_nccl_major}.${_nccl_minor}.${_nccl_patch}")
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)
if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
