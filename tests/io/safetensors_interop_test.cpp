// Interoperability with the reference implementation: files pulseloco writes open in the
// standard Python `safetensors` package with the right names, shapes, dtypes and bytes, and files
// that package writes open in pulseloco.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include <pulseloco/base/bf16.h>
#include <pulseloco/io/safetensors.h>
#include "io/python_check.h"
#include "io/test_files.h"

namespace pulseloco::io {
namespace {

using test::ExpectedTensor;
using test::run_safetensors_checker;
using test::TempDir;

template <typename T>
std::vector<std::byte> to_bytes(const std::vector<T>& values) {
  const auto bytes = std::as_bytes(std::span(values));
  return {bytes.begin(), bytes.end()};
}

// Writes `tensors` (each in a few chunks) with pulseloco's writer.
void write_with_pulseloco(const std::filesystem::path& path, const Metadata& metadata,
                          const std::vector<ExpectedTensor>& tensors) {
  std::vector<TensorSpec> specs;
  for (const ExpectedTensor& tensor : tensors)
    specs.push_back({tensor.name, tensor.dtype, tensor.shape});
  SafetensorsWriter writer(path, metadata, specs);
  for (const ExpectedTensor& tensor : tensors) {
    const std::span<const std::byte> all(tensor.bytes);
    const std::size_t chunk = std::max<std::size_t>(1, all.size() / 3 + 1);
    for (std::size_t done = 0; done < all.size(); done += chunk) {
      writer.write(tensor.name, all.subspan(done, std::min(chunk, all.size() - done)));
    }
  }
  writer.finish();
}

std::vector<ExpectedTensor> sample_tensors() {
  std::vector<float> weights(300 * 7);
  for (std::size_t i = 0; i < weights.size(); ++i) {
    weights[i] = std::sin(static_cast<float>(i)) * 0.02f;
  }
  std::vector<std::uint16_t> bf16(64);
  for (std::size_t i = 0; i < bf16.size(); ++i) {
    bf16[i] = float_to_bf16_bits(std::cos(static_cast<float>(i)) * 3.0f);
  }
  bf16[1] = 0x8000;  // -0
  const std::vector<std::int64_t> counters{0, -1, std::int64_t{1} << 40, 7};
  const std::vector<std::uint8_t> bytes{0, 1, 2, 253, 254, 255};
  const std::vector<double> scalar{0.7};
  return {
      {"global.weight", TensorDType::f32, {300, 7}, to_bytes(weights)},
      {"global.momentum", TensorDType::bf16, {8, 8}, to_bytes(bf16)},
      {"window", TensorDType::i64, {4}, to_bytes(counters)},
      {"outer_lr", TensorDType::f64, {}, to_bytes(scalar)},
      {"rank3.residual", TensorDType::f32, {0, 4}, {}},
      {"mask", TensorDType::u8, {2, 3}, to_bytes(bytes)},
  };
}

TEST(SafetensorsInterop, PythonReadsWhatPulselocoWrites) {
  TempDir dir;
  const Metadata metadata{{"format", "pulseloco-test"}, {"window", "3"}, {"ünïcode", "✓"}};
  const auto tensors = sample_tensors();
  write_with_pulseloco(dir.path() / "a.safetensors", metadata, tensors);
  test::write_expectation(dir.path() / "a.json", metadata, tensors);
  EXPECT_EQ(run_safetensors_checker("check", dir.path() / "a.safetensors", dir.path() / "a.json"),
            0);

  // No metadata at all, a single BF16 tensor (the numpy loader cannot hold BF16, so the checker
  // must take the raw-bytes path).
  const std::vector<ExpectedTensor> only_bf16{tensors[1]};
  write_with_pulseloco(dir.path() / "b.safetensors", {}, only_bf16);
  test::write_expectation(dir.path() / "b.json", {}, only_bf16);
  EXPECT_EQ(run_safetensors_checker("check", dir.path() / "b.safetensors", dir.path() / "b.json"),
            0);
}

TEST(SafetensorsInterop, CheckerReportsMismatches) {
  // The checker itself must be able to fail: a wrong byte, shape, dtype, name or metadata.
  TempDir dir;
  const auto tensors = sample_tensors();
  const auto file = dir.path() / "a.safetensors";
  write_with_pulseloco(file, {{"k", "v"}}, tensors);
  const auto expect = dir.path() / "a.json";

  auto wrong_byte = tensors;
  wrong_byte[0].bytes[17] ^= std::byte{1};
  test::write_expectation(expect, {{"k", "v"}}, wrong_byte);
  EXPECT_EQ(run_safetensors_checker("check", file, expect), 1);

  auto wrong_bf16 = tensors;
  wrong_bf16[1].bytes[0] ^= std::byte{1};
  test::write_expectation(expect, {{"k", "v"}}, wrong_bf16);
  EXPECT_EQ(run_safetensors_checker("check", file, expect), 1);

  auto wrong_shape = tensors;
  wrong_shape[0].shape = {7, 300};
  test::write_expectation(expect, {{"k", "v"}}, wrong_shape);
  EXPECT_EQ(run_safetensors_checker("check", file, expect), 1);

  auto wrong_dtype = tensors;
  wrong_dtype[2].dtype = TensorDType::u64;
  test::write_expectation(expect, {{"k", "v"}}, wrong_dtype);
  EXPECT_EQ(run_safetensors_checker("check", file, expect), 1);

  auto missing = tensors;
  missing.pop_back();
  test::write_expectation(expect, {{"k", "v"}}, missing);
  EXPECT_EQ(run_safetensors_checker("check", file, expect), 1);

  test::write_expectation(expect, {{"k", "w"}}, tensors);
  EXPECT_EQ(run_safetensors_checker("check", file, expect), 1);
}

TEST(SafetensorsInterop, PulselocoReadsWhatPythonWrites) {
  TempDir dir;
  const auto file = dir.path() / "py.safetensors";
  const auto expect_path = dir.path() / "py.json";
  ASSERT_EQ(run_safetensors_checker("write", file, expect_path), 0);
  std::ifstream in(expect_path);
  const nlohmann::json expected = nlohmann::json::parse(in);

  SafetensorsReader reader(file);
  EXPECT_EQ(reader.metadata(), expected.at("metadata").get<Metadata>());
  std::set<std::string> names;
  for (const TensorInfo& info : reader.tensors())
    names.insert(info.spec.name);
  std::set<std::string> expected_names;
  for (const auto& [name, _] : expected.at("tensors").items())
    expected_names.insert(name);
  EXPECT_EQ(names, expected_names);
  ASSERT_GE(names.size(), 8u);

  for (const auto& [name, want] : expected.at("tensors").items()) {
    SCOPED_TRACE(name);
    const TensorInfo& info = reader.tensor(name);
    EXPECT_EQ(tensor_dtype_name(info.spec.dtype), want.at("dtype").get<std::string>());
    EXPECT_EQ(info.spec.shape, want.at("shape").get<std::vector<std::uint64_t>>());
    std::vector<std::byte> bytes(info.byte_size());
    reader.read(name, bytes);
    EXPECT_EQ(test::sha256_hex(bytes), want.at("sha256").get<std::string>());
    // Element values, decoded per dtype.
    const auto& values = want.at("values");
    ASSERT_EQ(values.size(), info.spec.numel());
    for (std::size_t i = 0; i < values.size(); ++i) {
      const std::byte* p = bytes.data() + i * tensor_dtype_size(info.spec.dtype);
      switch (info.spec.dtype) {
        case TensorDType::f32: {
          float v;
          std::memcpy(&v, p, 4);
          EXPECT_EQ(v, values[i].get<float>());
          break;
        }
        case TensorDType::f64: {
          double v;
          std::memcpy(&v, p, 8);
          EXPECT_EQ(v, values[i].get<double>());
          break;
        }
        case TensorDType::i64: {
          std::int64_t v;
          std::memcpy(&v, p, 8);
          EXPECT_EQ(v, values[i].get<std::int64_t>());
          break;
        }
        case TensorDType::i32: {
          std::int32_t v;
          std::memcpy(&v, p, 4);
          EXPECT_EQ(v, values[i].get<std::int32_t>());
          break;
        }
        case TensorDType::u8:
          EXPECT_EQ(static_cast<int>(*p), values[i].get<int>());
          break;
        case TensorDType::boolean:
          EXPECT_EQ(*p != std::byte{0}, values[i].get<bool>());
          break;
        case TensorDType::f16:
          break;  // covered by the sha256 of the bytes
        default:
          ADD_FAILURE() << "unexpected dtype " << tensor_dtype_name(info.spec.dtype);
      }
    }
  }
}

}  // namespace
}  // namespace pulseloco::io
