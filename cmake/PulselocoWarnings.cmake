# Compiler settings shared by every pulseloco target.
add_library(pulseloco_compile_options INTERFACE)
target_compile_options(pulseloco_compile_options INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
    -Wcast-align -Wimplicit-fallthrough
    # Designated initialisers that leave fields at their defaults are idiomatic here (GCC < 14
    # warns about them).
    -Wno-missing-field-initializers>
  # GCC's null-dereference analysis depends on the optimisation level: test code, compiled at -O1
  # (tests/CMakeLists.txt), gets reports from inside libstdc++'s inlined vector code that -O3
  # proves unreachable. Everything else keeps the warning.
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<NOT:$<BOOL:$<TARGET_PROPERTY:PULSELOCO_TEST_CODE>>>>:-Wnull-dereference>
  # The window arithmetic must round every operation separately (pulseloco-algorithm.md, step 8):
  # no contraction anywhere; the two fused steps use std::fma / __fmaf_rn explicitly.
  $<$<COMPILE_LANGUAGE:CXX>:-ffp-contract=off>
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-ffp-contract=off --fmad=false>)
if(PULSELOCO_WARNINGS_AS_ERRORS)
  target_compile_options(pulseloco_compile_options INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-Werror>
    $<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings -Xcompiler=-Werror>)
endif()
if(PULSELOCO_SANITIZE)
  target_compile_options(pulseloco_compile_options INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-omit-frame-pointer
      -fno-sanitize-recover=undefined>)
  target_link_options(pulseloco_compile_options INTERFACE -fsanitize=address,undefined)
endif()
