// Test helper: two certificate authorities and certificates they signed, made with the openssl
// command-line tool (EC P-256) in a temporary directory that is removed afterwards.
#pragma once

#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>

#include <pulseloco/transport/tcp/tcp_options.h>

namespace pulseloco::transport::testing {

// A temporary directory, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "pulseloco-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  [[nodiscard]] std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// CAs "ca" and "other_ca"; leaf certificates "rank0", "rank1", "server" signed by "ca" and
// "stranger" signed by "other_ca".
class TestPki {
 public:
  TestPki() {
    make_ca("ca");
    make_ca("other_ca");
    for (const char* leaf : {"rank0", "rank1", "server"})
      make_leaf(leaf, "ca");
    make_leaf("stranger", "other_ca");
  }

  // The files of certificate `leaf`, trusting `ca`.
  [[nodiscard]] TlsFiles files(const std::string& leaf, const std::string& ca = "ca") const {
    return TlsFiles{dir_.file(leaf + ".pem"), dir_.file(leaf + ".key"), dir_.file(ca + ".pem")};
  }
  [[nodiscard]] const TempDir& dir() const noexcept { return dir_; }

 private:
  static constexpr const char* kKey = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes";

  void run(const std::string& command) const {
    if (std::system((command + " >/dev/null 2>&1").c_str()) != 0)
      throw std::runtime_error("test PKI: '" + command + "' failed (is openssl installed?)");
  }
  void make_ca(const std::string& name) const {
    run("openssl req -x509 " + std::string(kKey) + " -keyout " + dir_.file(name + ".key") +
        " -out " + dir_.file(name + ".pem") + " -subj /CN=" + name + " -days 2");
  }
  void make_leaf(const std::string& name, const std::string& ca) const {
    run("openssl req " + std::string(kKey) + " -keyout " + dir_.file(name + ".key") + " -out " +
        dir_.file(name + ".csr") + " -subj /CN=" + name);
    run("openssl x509 -req -in " + dir_.file(name + ".csr") + " -CA " + dir_.file(ca + ".pem") +
        " -CAkey " + dir_.file(ca + ".key") + " -CAcreateserial -out " + dir_.file(name + ".pem") +
        " -days 2");
  }

  TempDir dir_;
};

}  // namespace pulseloco::transport::testing
