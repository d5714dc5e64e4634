# ctest driver (cmake -P): configures and builds tests/codec/sanitized with clang-14, runs the
# malformed-input tests under ASan + UBSan, then each libFuzzer target from a freshly generated
# seed corpus. Variables: SOURCE_DIR (repository root), BINARY_DIR, CLANGXX, JOBS,
# DECODE_FUZZ_SECONDS, ROUNDTRIP_FUZZ_SECONDS.
foreach(var SOURCE_DIR BINARY_DIR CLANGXX JOBS DECODE_FUZZ_SECONDS ROUNDTRIP_FUZZ_SECONDS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_sanitized.cmake: ${var} is not set")
  endif()
endforeach()

function(run_step name)
  string(TIMESTAMP start "%s")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  string(TIMESTAMP end "%s")
  math(EXPR seconds "${end} - ${start}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "codec sanitized: ${name} failed (${rc}) after ${seconds} s")
  endif()
  message(STATUS "codec sanitized: ${name} passed in ${seconds} s")
endfunction()

set(ENV{ASAN_OPTIONS} "detect_leaks=1:abort_on_error=1:strict_string_checks=1")
set(ENV{UBSAN_OPTIONS} "print_stacktrace=1:halt_on_error=1")

run_step("configure (clang)" ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/codec/sanitized
  -B ${BINARY_DIR} -G Ninja -DCMAKE_CXX_COMPILER=${CLANGXX}
  -DPULSELOCO_SOURCE_DIR=${SOURCE_DIR})
run_step("build" ${CMAKE_COMMAND} --build ${BINARY_DIR} --parallel ${JOBS})
run_step("malformed-input tests under ASan+UBSan" ${BINARY_DIR}/codec_malformed_sanitized
  --gtest_brief=1)

file(REMOVE_RECURSE ${BINARY_DIR}/seeds ${BINARY_DIR}/corpus-decode ${BINARY_DIR}/corpus-roundtrip)
file(MAKE_DIRECTORY ${BINARY_DIR}/corpus-decode ${BINARY_DIR}/corpus-roundtrip)
run_step("seed corpus" ${BINARY_DIR}/codec_fuzz_seeds ${BINARY_DIR}/seeds)
# New inputs go to corpus-*; the seeds are read only. -timeout: seconds per input.
run_step("decode fuzzer for ${DECODE_FUZZ_SECONDS} s" ${BINARY_DIR}/codec_decode_fuzzer
  -max_total_time=${DECODE_FUZZ_SECONDS} -timeout=20 -rss_limit_mb=2048 -print_final_stats=1
  -artifact_prefix=${BINARY_DIR}/ ${BINARY_DIR}/corpus-decode ${BINARY_DIR}/seeds)
run_step("round-trip fuzzer for ${ROUNDTRIP_FUZZ_SECONDS} s" ${BINARY_DIR}/codec_roundtrip_fuzzer
  -max_total_time=${ROUNDTRIP_FUZZ_SECONDS} -timeout=20 -rss_limit_mb=2048 -max_len=4096
  -print_final_stats=1 -artifact_prefix=${BINARY_DIR}/ ${BINARY_DIR}/corpus-roundtrip)
