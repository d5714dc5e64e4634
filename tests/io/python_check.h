// Runs tests/io/safetensors_check.py (the standard `safetensors` package, from the venv that
// ./scripts/deps creates) on files the C++ code wrote, and reads the files it writes.
// A test target gets the interpreter and script paths with
// pulseloco_use_safetensors_checker(<target>) (tests/io/CMakeLists.txt).
#pragma once

#include <openssl/evp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <pulseloco/io/safetensors.h>

#if !defined(PULSELOCO_TEST_PYTHON) || !defined(PULSELOCO_SAFETENSORS_CHECKER)
#error "call pulseloco_use_safetensors_checker() on this test target"
#endif

namespace pulseloco::io::test {

inline std::string sha256_hex(std::span<const std::byte> bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr) != 1) {
    throw std::runtime_error("EVP_Digest(sha256) failed");
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < length; ++i) {
    hex.push_back(kHex[digest[i] >> 4]);
    hex.push_back(kHex[digest[i] & 15]);
  }
  return hex;
}

// What the Python side must find for one tensor.
struct ExpectedTensor {
  std::string name;
  TensorDType dtype = TensorDType::f32;
  std::vector<std::uint64_t> shape;
  std::vector<std::byte> bytes;  // raw little-endian data; its sha256 is compared
};

// Writes the checker's expectation file (format documented in safetensors_check.py).
inline void write_expectation(const std::filesystem::path& path, const Metadata& metadata,
                              const std::vector<ExpectedTensor>& tensors) {
  nlohmann::json expectation;
  expectation["metadata"] = metadata;
  expectation["exact"] = true;
  expectation["tensors"] = nlohmann::json::object();
  for (const ExpectedTensor& tensor : tensors) {
    expectation["tensors"][tensor.name] = {{"dtype", tensor_dtype_name(tensor.dtype)},
                                           {"shape", tensor.shape},
                                           {"sha256", sha256_hex(tensor.bytes)}};
    // BF16 has no numpy dtype: the checker views its bytes as uint16, so state the bits too.
    if (tensor.dtype == TensorDType::bf16 && tensor.bytes.size() <= 2 * 4096) {
      std::vector<std::uint16_t> bits(tensor.bytes.size() / 2);
      std::memcpy(bits.data(), tensor.bytes.data(), bits.size() * 2);
      expectation["tensors"][tensor.name]["values"] = bits;
    }
  }
  std::ofstream out(path);
  out << expectation.dump(1);
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

// Runs `python safetensors_check.py <mode> <file> <expectation>`; returns its exit status
// (its messages go to this process's stdout/stderr, so ctest shows them on failure).
inline int run_safetensors_checker(const std::string& mode, const std::filesystem::path& file,
                                   const std::filesystem::path& expectation) {
  const std::string python = PULSELOCO_TEST_PYTHON;
  const std::string script = PULSELOCO_SAFETENSORS_CHECKER;
  if (::access(python.c_str(), X_OK) != 0) {
    throw std::runtime_error("no Python interpreter at " + python +
                             " (run ./scripts/deps to create the .venv with safetensors)");
  }
  std::vector<std::string> args{python, script, mode, file.string(), expectation.string()};
  std::vector<char*> argv;
  for (std::string& arg : args)
    argv.push_back(arg.data());
  argv.push_back(nullptr);
  const pid_t child = ::fork();
  if (child < 0) throw std::runtime_error("fork failed");
  if (child == 0) {
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(child, &status, 0) < 0) {
    if (errno != EINTR) throw std::runtime_error("waitpid failed");
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace pulseloco::io::test
