// safetensors writer and reader: round trips, streaming, and every way a header can be wrong.
#include <pulseloco/io/safetensors.h>

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/errors.h>
#include "io/test_files.h"

namespace pulseloco::io {
namespace {

using test::read_file_bytes;
using test::TempDir;
using test::write_file_bytes;

template <typename T>
std::span<const std::byte> bytes_of(const std::vector<T>& values) {
  return std::as_bytes(std::span(values));
}

// A file with a raw header text and `data_size` data bytes (value = offset & 0xFF).
std::string raw_file(const std::string& header, std::size_t data_size) {
  std::string file(8, '\0');
  const std::uint64_t length = header.size();
  for (int i = 0; i < 8; ++i)
    file[i] = static_cast<char>((length >> (8 * i)) & 0xFF);
  file += header;
  for (std::size_t i = 0; i < data_size; ++i)
    file.push_back(static_cast<char>(i & 0xFF));
  return file;
}

// Expects that opening `contents` fails with `Kind` and a message containing `needle`.
template <typename Kind>
::testing::AssertionResult open_fails(const TempDir& dir, const std::string& contents,
                                      const std::string& needle) {
  const auto path = dir.path() / "bad.safetensors";
  write_file_bytes(path, contents);
  try {
    SafetensorsReader reader(path);
    return ::testing::AssertionFailure() << "opened without error";
  } catch (const Kind& error) {
    const std::string what = error.what();
    if (what.find(needle) == std::string::npos) {
      return ::testing::AssertionFailure() << "message lacks '" << needle << "': " << what;
    }
    if (what.find(path.string()) == std::string::npos) {
      return ::testing::AssertionFailure() << "message does not name the file: " << what;
    }
    return ::testing::AssertionSuccess();
  } catch (const std::exception& error) {
    return ::testing::AssertionFailure() << "wrong exception type: " << error.what();
  }
}

TEST(Safetensors, DTypeNamesAndSizes) {
  EXPECT_EQ(tensor_dtype_name(TensorDType::f32), "F32");
  EXPECT_EQ(tensor_dtype_name(TensorDType::bf16), "BF16");
  EXPECT_EQ(tensor_dtype_size(TensorDType::i64), 8u);
  EXPECT_EQ(tensor_dtype_size(TensorDType::bf16), 2u);
  EXPECT_EQ(tensor_dtype_size(TensorDType::u8), 1u);
  EXPECT_EQ(parse_tensor_dtype("U8"), TensorDType::u8);
  EXPECT_EQ(parse_tensor_dtype("F8_E5M2"), TensorDType::f8_e5m2);
  EXPECT_EQ(parse_tensor_dtype("f32"), std::nullopt);  // names are case-sensitive
  EXPECT_EQ(parse_tensor_dtype("Q4"), std::nullopt);
  EXPECT_EQ(to_tensor_dtype(DType::float32), TensorDType::f32);
  EXPECT_EQ(to_tensor_dtype(DType::bfloat16), TensorDType::bf16);
  EXPECT_EQ(to_core_dtype(TensorDType::bf16), DType::bfloat16);
  EXPECT_EQ(to_core_dtype(TensorDType::i64), std::nullopt);
}

TEST(Safetensors, RoundTripSeveralDTypesWithMetadata) {
  TempDir dir;
  const auto path = dir.path() / "state.safetensors";
  std::vector<float> weights(2 * 3);
  std::iota(weights.begin(), weights.end(), -2.5f);
  std::vector<std::uint16_t> bf16_values;
  for (float v : {1.0f, -0.015625f, 3.140625f, 0.0f})
    bf16_values.push_back(float_to_bf16_bits(v));
  const std::vector<std::int64_t> counter{-7, 1LL << 40};
  const std::vector<std::uint8_t> flags{0, 1, 255};

  SafetensorsWriter writer(path, {{"step", "12"}, {"note", "héllo"}},
                           {{"weights", TensorDType::f32, {2, 3}},
                            {"low", TensorDType::bf16, {4}},
                            {"counter", TensorDType::i64, {2}},
                            {"flags", TensorDType::u8, {3}}});
  writer.write(std::string_view("weights"), std::span<const float>(weights));
  writer.write("low", bytes_of(bf16_values));
  writer.write(std::string_view("counter"), std::span<const std::int64_t>(counter));
  writer.write(std::string_view("flags"), std::span<const std::uint8_t>(flags));
  writer.finish();
  EXPECT_EQ(std::filesystem::file_size(path), writer.file_size());

  SafetensorsReader reader(path);
  EXPECT_EQ(reader.metadata().at("step"), "12");
  EXPECT_EQ(reader.metadata().at("note"), "héllo");
  ASSERT_EQ(reader.tensors().size(), 4u);
  EXPECT_EQ(reader.tensors()[0].spec.name, "weights");  // offset order
  EXPECT_EQ(reader.data_section_offset() % 8, 0u);      // header padded to 8 bytes
  const TensorInfo& low = reader.tensor("low");
  EXPECT_EQ(low.spec.dtype, TensorDType::bf16);
  EXPECT_EQ(low.spec.shape, std::vector<std::uint64_t>{4});
  EXPECT_EQ(low.byte_size(), 8u);

  std::vector<float> weights_back(6);
  reader.read_as(std::string_view("weights"), std::span<float>(weights_back));
  EXPECT_EQ(weights_back, weights);
  std::vector<std::uint16_t> bf16_back(4);
  reader.read("low", std::as_writable_bytes(std::span(bf16_back)));
  EXPECT_EQ(bf16_back, bf16_values);
  std::vector<std::int64_t> counter_back(2);
  reader.read_as(std::string_view("counter"), std::span<std::int64_t>(counter_back));
  EXPECT_EQ(counter_back, counter);
  std::vector<std::uint8_t> flags_back(3);
  reader.read_as(std::string_view("flags"), std::span<std::uint8_t>(flags_back));
  EXPECT_EQ(flags_back, flags);

  // The header is exactly what the reference writer produces for this declaration.
  const std::string file = read_file_bytes(path);
  const std::string header = file.substr(8, reader.data_section_offset() - 8);
  EXPECT_EQ(header.substr(0, header.find_last_not_of(' ') + 1),
            R"({"__metadata__":{"note":"héllo","step":"12"},)"
            R"("weights":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
            R"("low":{"dtype":"BF16","shape":[4],"data_offsets":[24,32]},)"
            R"("counter":{"dtype":"I64","shape":[2],"data_offsets":[32,48]},)"
            R"("flags":{"dtype":"U8","shape":[3],"data_offsets":[48,51]}})");
}

TEST(Safetensors, StreamsLargeTensorInUnevenChunksAndReadsRanges) {
  TempDir dir;
  const auto path = dir.path() / "big.safetensors";
  const std::size_t count = 3'000'001;  // > the writer's 1 MiB buffer, odd size
  std::vector<float> values(count);
  for (std::size_t i = 0; i < count; ++i)
    values[i] = static_cast<float>(i) * 0.5f;
  {
    SafetensorsWriter writer(path, {},
                             {{"a", TensorDType::f32, {count}}, {"b", TensorDType::u8, {5}}});
    const auto all = bytes_of(values);
    std::size_t done = 0;
    std::size_t chunk = 1;
    while (done < all.size()) {  // chunk sizes 1, 7, 49, ... then large ones
      const std::size_t n = std::min(chunk, all.size() - done);
      writer.write("a", all.subspan(done, n));
      done += n;
      chunk = chunk * 7 % 5'000'011 + 3;
    }
    const std::vector<std::uint8_t> tail{1, 2, 3, 4, 5};
    writer.write("b", bytes_of(tail));
    writer.finish();
  }
  SafetensorsReader reader(path);
  EXPECT_TRUE(reader.metadata().empty());
  std::vector<float> back(count);
  reader.read_as(std::string_view("a"), std::span<float>(back));
  EXPECT_EQ(back, values);
  // Chunked loading: a range in the middle.
  std::vector<float> part(1000);
  reader.read_range("a", 4 * 123'457, std::as_writable_bytes(std::span(part)));
  EXPECT_EQ(part.front(), values[123'457]);
  EXPECT_EQ(part.back(), values[123'457 + 999]);
  // The last byte of a tensor is in range; one more is not.
  std::array<std::byte, 1> one{};
  reader.read_range("b", 4, one);
  EXPECT_EQ(one[0], std::byte{5});
  EXPECT_THROW(reader.read_range("b", 5, one), InvalidArgument);
  EXPECT_THROW(reader.read_range("b", ~std::uint64_t{0}, one), InvalidArgument);
}

TEST(Safetensors, ZeroElementTensorsAndScalars) {
  TempDir dir;
  const auto path = dir.path() / "empty.safetensors";
  const std::vector<double> scalar{2.25};
  {
    SafetensorsWriter writer(path, {},
                             {{"none", TensorDType::f32, {0}},
                              {"scalar", TensorDType::f64, {}},
                              {"empty_rows", TensorDType::bf16, {0, 16}},
                              {"also_none", TensorDType::i64, {3, 0}}});
    writer.write(std::string_view("scalar"), std::span<const double>(scalar));
    writer.finish();
  }
  SafetensorsReader reader(path);
  ASSERT_EQ(reader.tensors().size(), 4u);
  EXPECT_EQ(reader.tensor("none").byte_size(), 0u);
  EXPECT_EQ(reader.tensor("empty_rows").spec.shape, (std::vector<std::uint64_t>{0, 16}));
  EXPECT_EQ(reader.tensor("also_none").spec.numel(), 0u);
  EXPECT_TRUE(reader.tensor("scalar").spec.shape.empty());
  std::vector<double> back(1);
  reader.read_as(std::string_view("scalar"), std::span<double>(back));
  EXPECT_EQ(back[0], 2.25);
  reader.read("none", {});

  // A file with no tensors at all.
  const auto nothing = dir.path() / "nothing.safetensors";
  SafetensorsWriter writer(nothing, {{"k", "v"}}, {});
  writer.finish();
  SafetensorsReader empty(nothing);
  EXPECT_TRUE(empty.tensors().empty());
  EXPECT_EQ(empty.metadata().at("k"), "v");
}

TEST(Safetensors, WriterEnforcesOrderAndExactByteCounts) {
  TempDir dir;
  const auto path = dir.path() / "w.safetensors";
  const std::vector<float> four(4, 1.0f);
  const std::vector<float> five(5, 1.0f);
  {
    SafetensorsWriter writer(path, {},
                             {{"a", TensorDType::f32, {4}}, {"b", TensorDType::f32, {4}}});
    EXPECT_THROW(writer.write(std::string_view("b"), std::span<const float>(four)),
                 InvalidArgument);
    EXPECT_THROW(writer.finish(), InvalidArgument);  // broken after an error
  }
  {
    SafetensorsWriter writer(path, {}, {{"a", TensorDType::f32, {4}}});
    EXPECT_THROW(writer.write(std::string_view("a"), std::span<const float>(five)),
                 InvalidArgument);
  }
  {
    SafetensorsWriter writer(path, {}, {{"a", TensorDType::f32, {4}}});
    writer.write("a", bytes_of(four).first(15));
    try {
      writer.finish();
      FAIL() << "finish() accepted a short tensor";
    } catch (const InvalidArgument& error) {
      EXPECT_NE(std::string(error.what()).find("received 15 of its 16 bytes"), std::string::npos)
          << error.what();
    }
  }
  {
    SafetensorsWriter writer(path, {}, {{"a", TensorDType::f32, {4}}});
    writer.write(std::string_view("a"), std::span<const float>(four));
    EXPECT_THROW(writer.write(std::string_view("a"), std::span<const float>(four).first(1)),
                 InvalidArgument);  // past the last tensor
  }
  // None of the failed writers left a file, final or temporary.
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    ADD_FAILURE() << "left behind: " << entry.path();
  }
}

TEST(Safetensors, WriterRejectsBadDeclarations) {
  TempDir dir;
  const auto path = dir.path() / "x.safetensors";
  EXPECT_THROW(SafetensorsWriter(path, {}, {{"", TensorDType::f32, {1}}}), InvalidArgument);
  EXPECT_THROW(SafetensorsWriter(path, {}, {{"__metadata__", TensorDType::f32, {1}}}),
               InvalidArgument);
  EXPECT_THROW(
      SafetensorsWriter(path, {}, {{"a", TensorDType::f32, {1}}, {"a", TensorDType::u8, {1}}}),
      InvalidArgument);
  EXPECT_THROW(SafetensorsWriter(path, {}, {{"a", TensorDType::f32, {1ULL << 32, 1ULL << 32}}}),
               InvalidArgument);  // 2^64 elements
  EXPECT_THROW(SafetensorsWriter(path, {}, {{"a", TensorDType::f64, {1ULL << 62}}}),
               InvalidArgument);  // 2^65 bytes
  EXPECT_THROW(
      SafetensorsWriter(
          path, {}, {{"a", TensorDType::u8, {1ULL << 63}}, {"b", TensorDType::u8, {1ULL << 63}}}),
      InvalidArgument);  // offsets overflow
  EXPECT_THROW(SafetensorsWriter(path, {}, {{"bad\xff", TensorDType::u8, {1}}}), InvalidArgument);
  EXPECT_THROW(SafetensorsWriter(path, {{"k", "\xc3"}}, {}), InvalidArgument);
  EXPECT_THROW(SafetensorsWriter(dir.path() / "missing_dir" / "x.safetensors", {}, {}), IoError);
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(Safetensors, ReplacingAFileIsAtomic) {
  TempDir dir;
  const auto path = dir.path() / "ckpt.safetensors";
  const std::vector<float> old_values{1, 2};
  {
    SafetensorsWriter writer(path, {{"version", "old"}}, {{"w", TensorDType::f32, {2}}});
    writer.write(std::string_view("w"), std::span<const float>(old_values));
    writer.finish();
  }
  const std::string before = read_file_bytes(path);
  {
    // A replacement that is abandoned half-way (e.g. the process hits an error).
    SafetensorsWriter writer(path, {{"version", "new"}}, {{"w", TensorDType::f32, {2}}});
    writer.write(std::string_view("w"), std::span<const float>(old_values).first(1));
    // While it is in progress, the final name still holds the complete old file.
    EXPECT_EQ(read_file_bytes(path), before);
  }
  EXPECT_EQ(read_file_bytes(path), before);
  SafetensorsReader reader(path);
  EXPECT_EQ(reader.metadata().at("version"), "old");
}

TEST(Safetensors, ReaderRefusesTruncatedAndMalformedFiles) {
  TempDir dir;
  EXPECT_TRUE(open_fails<ProtocolError>(dir, "", "fewer than the 8-byte header length"));
  EXPECT_TRUE(open_fails<ProtocolError>(dir, "abc", "fewer than the 8-byte header length"));
  // Header length larger than the file, and larger than the cap.
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file("{}", 0).substr(0, 9), "exceeds the"));
  std::string huge = raw_file("{}", 0);
  huge[5] = '\x01';  // 2^40 + 2
  EXPECT_TRUE(open_fails<ProtocolError>(dir, huge, "exceeds the limit"));
  std::string all_ones(8, '\xff');
  EXPECT_TRUE(open_fails<ProtocolError>(dir, all_ones + "{}", "exceeds the limit"));
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file("", 0), "does not start with '{'"));
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file(" {}", 0), "does not start with '{'"));
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file("[]", 0), "does not start with '{'"));
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file("{\"a\":", 0), "not valid JSON"));
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file("{} x", 0), "not valid JSON"));
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file("{\"\xff\":1}", 0), "not valid JSON"));
  // Truncating a valid file anywhere is detected.
  const auto good = dir.path() / "good.safetensors";
  {
    const std::vector<float> values(10, 3.0f);
    SafetensorsWriter writer(good, {{"a", "b"}}, {{"w", TensorDType::f32, {10}}});
    writer.write(std::string_view("w"), std::span<const float>(values));
    writer.finish();
  }
  const std::string full = read_file_bytes(good);
  for (std::size_t cut = 0; cut < full.size(); ++cut) {
    const auto path = dir.path() / "cut.safetensors";
    write_file_bytes(path, full.substr(0, cut));
    EXPECT_THROW(SafetensorsReader{path}, ProtocolError) << "cut at " << cut;
  }
  // Trailing bytes no tensor owns.
  EXPECT_TRUE(open_fails<ProtocolError>(dir, full + "x", "cover only"));
}

TEST(Safetensors, ReaderRefusesEveryBadHeaderField) {
  TempDir dir;
  auto one = [](const std::string& fields) { return "{\"w\":{" + fields + "}}"; };
  const std::string ok_offsets = "\"data_offsets\":[0,8]";
  // dtype
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file(one("\"shape\":[2]," + ok_offsets), 8),
                                        "missing field 'dtype'"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"Q4\",\"shape\":[2]," + ok_offsets), 8), "unknown dtype 'Q4'"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":4,\"shape\":[2]," + ok_offsets), 8), "'dtype' is not a string"));
  // shape
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file(one("\"dtype\":\"F32\"," + ok_offsets), 8),
                                        "missing field 'shape'"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"shape\":2," + ok_offsets), 8), "not an array"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"shape\":[-2]," + ok_offsets), 8), "negative"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"shape\":[2.0]," + ok_offsets), 8), "not an integer"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"shape\":[\"2\"]," + ok_offsets), 8),
      "not an integer"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"shape\":[[2]]," + ok_offsets), 8), "deeper"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"shape\":[3]," + ok_offsets), 8),
      "needs 12 bytes but data_offsets [0, 8] span 8"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"shape\":[99999999999999999999]," + ok_offsets), 8),
      "not an integer that fits in 64 bits"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"shape\":[4294967296,4294967296]," + ok_offsets), 8),
      "overflows 64 bits"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F64\",\"shape\":[4611686018427387904]," + ok_offsets), 8),
      "overflows 64 bits"));
  // data_offsets
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file(one("\"dtype\":\"F32\",\"shape\":[2]"), 8),
                                        "missing field 'data_offsets'"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]"), 8),
      "array of two integers"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,8]"), 8),
      "array of two integers"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]"), 8),
      "end before they begin"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-1,8]"), 8),
      "negative"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]"), 7),
      "reach past the data section"));
  // Huge declared sizes are refused by arithmetic, not by trying to allocate them.
  EXPECT_TRUE(open_fails<ProtocolError>(dir,
                                        raw_file(one("\"dtype\":\"U8\",\"shape\":[1099511627776],"
                                                     "\"data_offsets\":[0,1099511627776]"),
                                                 8),
                                        "reach past the data section"));
  // Unknown fields and bad entries.
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"shape\":[2]," + ok_offsets + ",\"extra\":1"), 8),
      "unknown field 'extra'"));
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file("{\"w\":[1,2]}", 0), "not an object"));
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file("{\"\":{}}", 0), "empty name"));
  // Duplicate keys, at both levels.
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir,
      raw_file("{\"w\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]},"
               "\"w\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}",
               0),
      "appears twice"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file(one("\"dtype\":\"F32\",\"dtype\":\"U8\",\"shape\":[2]," + ok_offsets), 8),
      "appears twice"));
  // __metadata__
  EXPECT_TRUE(
      open_fails<ProtocolError>(dir, raw_file("{\"__metadata__\":[]}", 0), "not an object"));
  EXPECT_TRUE(
      open_fails<ProtocolError>(dir, raw_file("{\"__metadata__\":{\"k\":1}}", 0), "not a string"));
  EXPECT_TRUE(open_fails<ProtocolError>(
      dir, raw_file("{\"__metadata__\":{\"k\":{\"x\":\"y\"}}}", 0), "not a string"));
}

TEST(Safetensors, ReaderRefusesOverlapsAndGaps) {
  TempDir dir;
  auto two = [](const std::string& a, const std::string& b) {
    return "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":" + a +
           "},\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":" + b + "}}";
  };
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file(two("[0,4]", "[2,6]"), 8), "overlap"));
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file(two("[0,4]", "[0,4]"), 8), "overlap"));
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file(two("[0,4]", "[5,9]"), 9),
                                        "bytes [4, 5) of the data section belong to no tensor"));
  EXPECT_TRUE(open_fails<ProtocolError>(dir, raw_file(two("[1,5]", "[5,9]"), 9), "bytes [0, 1)"));
  // Out of order in the header is fine when they tile the section.
  const auto path = dir.path() / "unsorted.safetensors";
  write_file_bytes(path, raw_file(two("[4,8]", "[0,4]"), 8));
  SafetensorsReader reader(path);
  EXPECT_EQ(reader.tensors()[0].spec.name, "b");
  std::array<std::byte, 4> a{};
  reader.read("a", a);
  EXPECT_EQ(a[0], std::byte{4});
}

TEST(Safetensors, ErrorsNameTensorAndByteOffset) {
  TempDir dir;
  const auto path = dir.path() / "bad.safetensors";
  const std::string header =
      "{\"good\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
      "\"broken\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[6,10]}}";
  write_file_bytes(path, raw_file(header, 10));
  try {
    SafetensorsReader reader(path);
    FAIL() << "opened";
  } catch (const ProtocolError& error) {
    EXPECT_EQ(error.context().tensor, "broken");
    ASSERT_TRUE(error.context().byte_offset.has_value());
    EXPECT_EQ(*error.context().byte_offset, 8 + header.size() + 4);  // start of the gap
  }
  // A JSON syntax error points at the offending byte of the file.
  write_file_bytes(path, raw_file("{\"a\" 1}", 0));
  try {
    SafetensorsReader reader(path);
    FAIL() << "opened";
  } catch (const ProtocolError& error) {
    ASSERT_TRUE(error.context().byte_offset.has_value());
    EXPECT_EQ(*error.context().byte_offset, 8u + 5u);
  }
}

TEST(Safetensors, HugeDeclaredSizesDoNotAllocate) {
  // A header declaring a 1 TiB tensor in a 56-byte file must be refused by validation; a reader
  // that allocated the declared size would throw std::bad_alloc (or exhaust memory) instead.
  TempDir dir;
  const auto path = dir.path() / "huge.safetensors";
  write_file_bytes(path, raw_file("{\"w\":{\"dtype\":\"F32\",\"shape\":[274877906944],"
                                  "\"data_offsets\":[0,1099511627776]}}",
                                  16));
  EXPECT_THROW(SafetensorsReader{path}, ProtocolError);
  // Many tensors that each claim the whole (small) data section are refused as overlaps.
  std::string header = "{";
  for (int i = 0; i < 1000; ++i) {
    if (i > 0) header += ',';
    header += "\"t";
    header += std::to_string(i);
    header += "\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[0,16]}";
  }
  header += "}";
  write_file_bytes(path, raw_file(header, 16));
  EXPECT_THROW(SafetensorsReader{path}, ProtocolError);
}

TEST(Safetensors, MissingFileAndTypedReadChecks) {
  TempDir dir;
  EXPECT_THROW(SafetensorsReader(dir.path() / "absent.safetensors"), IoError);
  EXPECT_THROW(SafetensorsReader(dir.path()), InvalidArgument);  // a directory
  // A FIFO is refused without waiting for a writer (opening it for reading would block).
  const auto fifo = dir.path() / "fifo.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  try {
    (void)SafetensorsReader(fifo);
    ADD_FAILURE() << "a FIFO was accepted";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("is a FIFO, not a safetensors file"),
              std::string::npos)
        << error.what();
  }
  const auto path = dir.path() / "t.safetensors";
  const std::vector<float> values(3, 1.0f);
  {
    SafetensorsWriter writer(path, {}, {{"w", TensorDType::f32, {3}}});
    writer.write(std::string_view("w"), std::span<const float>(values));
    writer.finish();
  }
  SafetensorsReader reader(path);
  std::vector<std::int32_t> wrong_type(3);
  EXPECT_THROW(reader.read_as(std::string_view("w"), std::span<std::int32_t>(wrong_type)),
               InvalidArgument);
  std::vector<float> wrong_count(2);
  EXPECT_THROW(reader.read_as(std::string_view("w"), std::span<float>(wrong_count)),
               InvalidArgument);
  EXPECT_THROW((void)reader.tensor("v"), InvalidArgument);
  EXPECT_FALSE(reader.contains("v"));
  EXPECT_TRUE(reader.contains("w"));
  // Moving a reader keeps it usable.
  SafetensorsReader moved = std::move(reader);
  std::vector<float> back(3);
  moved.read_as(std::string_view("w"), std::span<float>(back));
  EXPECT_EQ(back, values);
}

}  // namespace
}  // namespace pulseloco::io
