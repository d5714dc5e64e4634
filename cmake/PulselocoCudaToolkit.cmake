# pulseloco_find_cuda_toolkit([find_package arguments]): find_package(CUDAToolkit ...) that also
# works with CMake 3.25 and CUDA 13.
#
# CMake 3.25's FindCUDAToolkit marks the target CUDA::nvToolsExt as deprecated whenever the
# calling project requires CMake >= 3.25, without checking that the target was created. CUDA 13
# no longer ships libnvToolsExt, so the stock module stops the configure step with "set_property
# could not find TARGET CUDA::nvToolsExt" (later CMake releases check first). The module is run
# as a project requiring 3.24 would run it: the only difference is that deprecation mark, on a
# library pulseloco never uses.
macro(pulseloco_find_cuda_toolkit)
  set(_pulseloco_minimum_required "${CMAKE_MINIMUM_REQUIRED_VERSION}")
  if(CMAKE_VERSION VERSION_LESS 3.26)
    set(CMAKE_MINIMUM_REQUIRED_VERSION 3.24)
  endif()
  find_package(CUDAToolkit ${ARGN})
  set(CMAKE_MINIMUM_REQUIRED_VERSION "${_pulseloco_minimum_required}")
  unset(_pulseloco_minimum_required)
endmacro()
