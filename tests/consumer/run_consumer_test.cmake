# Installs this build into a prefix, then configures, builds and runs a separate project that
# finds it with find_package(pulseloco). EXTRA_ARGS (a ;-list) reach the project's configure
# step (e.g. -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON), EXPECT is a regex its output must match; with
# EXPECT_CONFIGURE_FAILURE the configure step must fail and its output match EXPECT instead.
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " command "${ARGN}")
    message(FATAL_ERROR "'${command}' failed (${rc}):\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

run(${CMAKE_COMMAND} --install ${PULSELOCO_BUILD_DIR} --prefix ${prefix})
set(configure_args -S ${PROJECT_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
  -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=${BUILD_TYPE}
  -DCMAKE_CXX_COMPILER=${CXX_COMPILER} ${EXTRA_ARGS})
if(CUDA_COMPILER AND NOT EXTRA_ARGS MATCHES "DISABLE_FIND_PACKAGE_CUDAToolkit")
  get_filename_component(cuda_bin ${CUDA_COMPILER} DIRECTORY)
  get_filename_component(cuda_root ${cuda_bin} DIRECTORY)
  list(APPEND configure_args -DCUDAToolkit_ROOT=${cuda_root})
endif()
if(EXPECT_CONFIGURE_FAILURE)
  execute_process(COMMAND ${CMAKE_COMMAND} ${configure_args} RESULT_VARIABLE rc
    OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0)
    message(FATAL_ERROR "the consumer configured although it should not:\n${out}\n${err}")
  endif()
  if(NOT "${out}${err}" MATCHES "${EXPECT}")
    message(FATAL_ERROR "unexpected configure output (wanted '${EXPECT}'):\n${out}\n${err}")
  endif()
  message(STATUS "configure failed as expected")
  return()
endif()
run(${CMAKE_COMMAND} ${configure_args})
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
file(GLOB program ${WORK_DIR}/build/pulseloco_consumer*)
list(FILTER program EXCLUDE REGEX "\\.")
run(${program})
if(NOT last_output MATCHES "${EXPECT}")
  message(FATAL_ERROR "unexpected consumer output: ${last_output}")
endif()
message(STATUS "${last_output}")
