# Required dependencies (Debian 12 packages; ./scripts/deps installs them).
find_package(Threads REQUIRED)
find_package(fmt REQUIRED)               # libfmt-dev
find_package(spdlog REQUIRED)            # libspdlog-dev
find_package(xxhash REQUIRED)            # libxxhash-dev (cmake/Findxxhash.cmake)
find_package(zstd REQUIRED)              # libzstd-dev
find_package(Boost 1.74 REQUIRED)        # libboost-dev (header-only Asio)
find_package(OpenSSL REQUIRED)           # libssl-dev (HMAC-SHA256 peer authentication)
find_package(nlohmann_json 3 REQUIRED)   # nlohmann-json3-dev
find_package(CLI11 REQUIRED)             # libcli11-dev

if(TARGET zstd::libzstd_shared)
  set(PULSELOCO_ZSTD_TARGET zstd::libzstd_shared)
else()
  set(PULSELOCO_ZSTD_TARGET zstd::libzstd_static)
endif()

if(PULSELOCO_BUILD_TESTS)
  find_package(GTest REQUIRED)           # googletest / libgtest-dev
endif()
if(PULSELOCO_BUILD_BENCHMARKS)
  find_package(benchmark REQUIRED)       # libbenchmark-dev
endif()
