// safetensors reader/writer: round trips of every dtype, and bad files, each of which must be
// refused with a dsv3::Error that names the file and the problem (never a crash or a bad view).
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/mmap_file.h"
#include "io/safetensors.h"

using namespace dsv3;

namespace {

// A fresh folder under gtest's temp dir, removed (with its files) at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = testing::TempDir() + "dsv3_st_XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (!mkdtemp(buf.data())) ADD_FAILURE() << "mkdtemp failed for " << tmpl;
    dir_ = buf.data();
  }
  ~TempDir() {
    for (auto& f : files_) ::unlink(f.c_str());
    ::rmdir(dir_.c_str());
  }
  // Writes bytes to a file named `name` in the folder and returns its path.
  std::string write(const std::string& name, const std::string& bytes) {
    std::string path = dir_ + "/" + name;
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), std::streamsize(bytes.size()));
    f.close();
    files_.push_back(path);
    return path;
  }
  std::string path(const std::string& name) {
    files_.push_back(dir_ + "/" + name);
    return files_.back();
  }

 private:
  std::string dir_;
  std::vector<std::string> files_;
};

// The 8-byte little-endian length prefix followed by `header` and `data`, byte for byte.
std::string raw_file(const std::string& header, const std::string& data = "") {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char((n >> (8 * i)) & 0xff);
  return out + header + data;
}

// Runs fn, which must throw dsv3::Error; returns the message ("" and a failure otherwise).
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw a non-dsv3 exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "did not throw";
  return "";
}

void expect_contains(const std::string& msg, std::initializer_list<const char*> parts) {
  for (const char* p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
}

// Opening the file must fail with a message naming the file and containing each of `parts`.
void expect_bad_file(TempDir& tmp, const std::string& name, const std::string& bytes,
                     std::initializer_list<const char*> parts) {
  SCOPED_TRACE(name);
  std::string path = tmp.write(name, bytes);
  std::string msg = error_of([&] { SafetensorsFile f(path); });
  expect_contains(msg, {path.c_str()});
  expect_contains(msg, parts);
}

std::string one_tensor(const std::string& entry) { return "{\"t\":" + entry + "}"; }

}  // namespace

TEST(Safetensors, RoundTripsEveryDtypeWithScalarsEmptiesAndMetadata) {
  std::vector<float> f32 = {1.f, -2.5f, 3.25f, 0.f, -0.f, 1e-30f};
  std::vector<uint16_t> bf16 = {0x3f80, 0xc020, 0x7f80, 0x0001};
  std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x8000, 0x3555};
  std::vector<uint8_t> e4m3 = {0x00, 0x38, 0x7e, 0xfe, 0x01, 0x80, 0x40, 0x22};
  std::vector<int32_t> i32 = {0, -1, 2147483647, -2147483647 - 1};
  std::vector<int64_t> i64 = {int64_t(1) << 40, -7, 0};
  std::vector<uint8_t> u8 = {0, 1, 254, 255, 7};
  float scalar = 42.5f;
  int64_t scalar_i64 = -123456789012345;
  std::vector<NamedTensor> ts = {
      {"f32", DType::F32, {2, 3}, f32.data()},
      {"bf16", DType::BF16, {4}, bf16.data()},
      {"f16", DType::F16, {3, 2}, f16.data()},
      {"layers.0.weight_e4m3", DType::F8_E4M3, {2, 2, 2}, e4m3.data()},
      {"i32", DType::I32, {4}, i32.data()},
      {"i64", DType::I64, {3, 1}, i64.data()},
      {"u8", DType::U8, {5}, u8.data()},
      {"scalar", DType::F32, {}, &scalar},          // 0-d: one element
      {"scalar_i64", DType::I64, {}, &scalar_i64},
      {"empty", DType::BF16, {0}, nullptr},         // no bytes at all
      {"empty_2d", DType::F32, {3, 0}, nullptr},
  };
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "quotes \" and \\ survive"}};

  TempDir tmp;
  std::string path = tmp.path("all.safetensors");
  write_safetensors(path, ts, meta);
  SafetensorsFile f(path);
  EXPECT_EQ(f.metadata(), meta);
  EXPECT_EQ(f.entries().size(), ts.size());
  for (auto& t : ts) {
    SCOPED_TRACE(t.name);
    ASSERT_TRUE(f.has(t.name));
    TensorView v = f.get(t.name);
    EXPECT_EQ(v.dtype, t.dtype);
    EXPECT_EQ(v.shape, t.shape);
    int64_t numel = 1;
    for (auto d : t.shape) numel *= d;
    EXPECT_EQ(v.numel(), numel);
    ASSERT_EQ(v.nbytes(), size_t(numel) * dtype_size(t.dtype));
    if (v.nbytes()) {
      EXPECT_EQ(std::memcmp(v.data, t.data, v.nbytes()), 0);
    }
    // Typed loads from the mapping need the data aligned to the element size.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data) % dtype_size(t.dtype), 0u);
  }
  EXPECT_EQ(load_f32(f.get("scalar"), 0), 42.5f);
  EXPECT_EQ(load_f32(f.get("bf16"), 1), -2.5f);
  EXPECT_EQ(load_f32(f.get("layers.0.weight_e4m3"), 2), 448.f);
  EXPECT_EQ(f.get("i64").as<int64_t>()[0], int64_t(1) << 40);

  // The in-memory serialisation is the same bytes, parses alike, and keeps the data 8-aligned.
  std::string bytes = safetensors_bytes(ts, meta);
  EXPECT_EQ(bytes, read_text_file(path));
  SafetensorsHeader h = parse_safetensors_header(reinterpret_cast<const uint8_t*>(bytes.data()),
                                                 bytes.size(), bytes.size(), "mem");
  EXPECT_EQ(h.data_start % 8, 0u);
  EXPECT_EQ(h.tensors.size(), ts.size());
  EXPECT_EQ(h.metadata, meta);
}

TEST(Safetensors, RoundTripsAnEmptyFile) {
  TempDir tmp;
  std::string path = tmp.path("none.safetensors");
  write_safetensors(path, {});
  SafetensorsFile f(path);
  EXPECT_TRUE(f.entries().empty());
  EXPECT_TRUE(f.metadata().empty());
}

TEST(Safetensors, WriterRefusesDuplicateAndReservedNames) {
  float x = 1.f;
  std::string msg = error_of([&] {
    safetensors_bytes({{"a", DType::F32, {}, &x}, {"a", DType::F32, {}, &x}});
  });
  expect_contains(msg, {"'a'", "more than once"});
  msg = error_of([&] { safetensors_bytes({{"__metadata__", DType::F32, {}, &x}}); });
  expect_contains(msg, {"__metadata__", "reserved"});
}

TEST(Safetensors, AcceptsHandWrittenValidFiles) {
  TempDir tmp;
  // Tensors out of order in the header, an empty tensor at the end of the data, no padding.
  std::string path = tmp.write(
      "ok.safetensors",
      raw_file(R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},)"
               R"("a":{"dtype":"U8","shape":[1,2],"data_offsets":[0,2]},)"
               R"("z":{"dtype":"F32","shape":[0,5],"data_offsets":[4,4]}})",
               "\x01\x02\x03\x04"));
  SafetensorsFile f(path);
  EXPECT_EQ(f.get("a").as<uint8_t>()[1], 2);
  EXPECT_EQ(f.get("b").as<uint8_t>()[0], 3);
  EXPECT_EQ(f.get("z").numel(), 0);
}

TEST(Safetensors, RefusesTruncatedPrefixAndHeader) {
  TempDir tmp;
  expect_bad_file(tmp, "empty", "", {"truncated", "8-byte"});
  expect_bad_file(tmp, "short", "abc", {"truncated", "3 bytes"});
  expect_bad_file(tmp, "seven", std::string(7, '\0'), {"truncated"});
  std::string past = raw_file("{}");
  past[0] = char(100);  // claims a 100-byte header in an 10-byte file
  expect_bad_file(tmp, "hlen_past_eof", past, {"header length 100", "exceeds the file size 10"});
  std::string huge(8, '\xff');  // 2^64-1: must not wrap around when adding 8
  expect_bad_file(tmp, "hlen_max", huge + "{}", {"exceeds the file size"});
}

TEST(Safetensors, RefusesHeadersThatAreNotAJsonObject) {
  TempDir tmp;
  expect_bad_file(tmp, "not_json", raw_file("{\"a\": "), {"not valid JSON"});
  expect_bad_file(tmp, "zero_len", raw_file(""), {"not valid JSON"});
  expect_bad_file(tmp, "trailing", raw_file("{} x"), {"not valid JSON"});
  expect_bad_file(tmp, "array", raw_file("[1, 2]"), {"not a JSON object"});
  expect_bad_file(tmp, "string", raw_file("\"hi\""), {"not a JSON object"});
  expect_bad_file(tmp, "entry_not_object", raw_file(one_tensor("[1]")), {"'t'", "not an object"});
}

TEST(Safetensors, RefusesBadEntries) {
  TempDir tmp;
  auto entry = [](const std::string& dtype, const std::string& shape, const std::string& offs) {
    return one_tensor("{\"dtype\":" + dtype + ",\"shape\":" + shape + ",\"data_offsets\":" + offs + "}");
  };
  const std::string data(16, '\0');
  expect_bad_file(tmp, "unknown_dtype", raw_file(entry("\"F64\"", "[2]", "[0,16]"), data),
                  {"'t'", "unsupported dtype 'F64'"});
  expect_bad_file(tmp, "dtype_not_string", raw_file(entry("4", "[2]", "[0,16]"), data), {"'t'", "dtype"});
  expect_bad_file(tmp, "no_dtype", raw_file(one_tensor(R"({"shape":[1],"data_offsets":[0,1]})"), data),
                  {"'t'", "missing or non-string dtype"});
  expect_bad_file(tmp, "no_shape", raw_file(one_tensor(R"({"dtype":"U8","data_offsets":[0,1]})"), data),
                  {"'t'", "shape"});
  expect_bad_file(tmp, "negative_shape", raw_file(entry("\"U8\"", "[-1]", "[0,1]"), data),
                  {"'t'", "shape entries must be non-negative integers"});
  expect_bad_file(tmp, "fractional_shape", raw_file(entry("\"U8\"", "[2.5]", "[0,2]"), data),
                  {"'t'", "shape entries must be non-negative integers"});
  expect_bad_file(tmp, "string_shape", raw_file(entry("\"U8\"", "[\"2\"]", "[0,2]"), data),
                  {"'t'", "shape entries must be non-negative integers"});
  expect_bad_file(tmp, "shape_overflow",
                  raw_file(entry("\"U8\"", "[1099511627776, 1099511627776]", "[0,1]"), data),
                  {"'t'", "shape too large"});
  expect_bad_file(tmp, "offsets_one", raw_file(entry("\"U8\"", "[1]", "[0]"), data),
                  {"'t'", "data_offsets must be [begin, end]"});
  expect_bad_file(tmp, "offsets_negative", raw_file(entry("\"U8\"", "[1]", "[-1,0]"), data),
                  {"'t'", "data_offsets must be non-negative integers"});
  expect_bad_file(tmp, "offsets_reversed", raw_file(entry("\"U8\"", "[4]", "[8,4]"), data),
                  {"'t'", "data_offsets [8, 4] are reversed"});
  // 16 data bytes, the header asks for [0, 24): the file was cut short.
  expect_bad_file(tmp, "truncated_data", raw_file(entry("\"F32\"", "[6]", "[0,24]"), data),
                  {"'t'", "end 24 is past the data section (16 bytes)"});
  expect_bad_file(tmp, "byte_count", raw_file(entry("\"F32\"", "[3]", "[0,8]"), data),
                  {"'t'", "holds 8 bytes", "F32", "[3]", "needs 12"});
  expect_bad_file(tmp, "byte_count_scalar", raw_file(entry("\"I64\"", "[]", "[0,4]"), data),
                  {"'t'", "holds 4 bytes", "needs 8"});
}

TEST(Safetensors, RefusesOverlappingTensors) {
  TempDir tmp;
  expect_bad_file(tmp, "overlap",
                  raw_file(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})",
                           std::string(16, '\0')),
                  {"'a'", "'b'", "overlapping"});
  expect_bad_file(tmp, "same_range",
                  raw_file(R"({"a":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                           std::string(8, '\0')),
                  {"overlapping"});
  // A third tensor inside the first, listed after a harmless second one.
  expect_bad_file(tmp, "nested",
                  raw_file(R"({"a":{"dtype":"U8","shape":[12],"data_offsets":[0,12]},)"
                           R"("b":{"dtype":"U8","shape":[4],"data_offsets":[12,16]},)"
                           R"("c":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                           std::string(16, '\0')),
                  {"'a'", "'c'", "overlapping"});
}

TEST(Safetensors, RefusesBadMetadata) {
  TempDir tmp;
  expect_bad_file(tmp, "meta_array", raw_file(R"({"__metadata__":["a"]})"),
                  {"__metadata__ is not an object"});
  expect_bad_file(tmp, "meta_number", raw_file(R"({"__metadata__":{"format":"pt","n":1}})"),
                  {"__metadata__ value 'n' is not a string"});
  expect_bad_file(tmp, "meta_nested", raw_file(R"({"__metadata__":{"o":{"x":"y"}}})"),
                  {"__metadata__ value 'o' is not a string"});
}

TEST(Safetensors, GetOfAMissingTensorNamesTensorAndFile) {
  TempDir tmp;
  float x = 3.f;
  std::string path = tmp.path("one.safetensors");
  write_safetensors(path, {{"present", DType::F32, {1}, &x}});
  SafetensorsFile f(path);
  EXPECT_FALSE(f.has("absent"));
  std::string msg = error_of([&] { f.get("absent"); });
  expect_contains(msg, {path.c_str(), "no tensor named 'absent'"});
}

TEST(Safetensors, RefusesMissingFilesAndFolders) {
  TempDir tmp;
  std::string missing = tmp.path("nope.safetensors");
  expect_contains(error_of([&] { SafetensorsFile f(missing); }), {missing.c_str(), "cannot open"});
  std::string dir = testing::TempDir();
  expect_contains(error_of([&] { SafetensorsFile f(dir); }), {"not a regular file"});
}

TEST(Safetensors, HeaderParserChecksWhatTheCallerHandsIt) {
  std::string bytes = raw_file("{}");
  auto p = reinterpret_cast<const uint8_t*>(bytes.data());
  // Only the prefix was read so far: the header is not all there.
  expect_contains(error_of([&] { parse_safetensors_header(p, 9, bytes.size(), "part.st"); }),
                  {"part.st", "header not fully available"});
  // A header length that fits the (claimed) file but is absurd.
  std::string big(8, '\0');
  uint64_t n = uint64_t(200) << 20;
  for (int i = 0; i < 8; ++i) big[size_t(i)] = char((n >> (8 * i)) & 0xff);
  expect_contains(error_of([&] {
                    parse_safetensors_header(reinterpret_cast<const uint8_t*>(big.data()), 8,
                                             uint64_t(1) << 40, "big.st");
                  }),
                  {"big.st", "implausibly large"});
}

TEST(Safetensors, ReadsTheGoldenShardedCheckpoints) {
  // Every shard of every golden checkpoint parses and every tensor's bytes lie inside the file.
  for (const char* model : {"v2_groups_bf16", "v2lite_bf16", "v3_fp8"}) {
    std::string dir = std::string(DSV3_TEST_DATA) + "/golden/models/" + model + "/hf/";
    std::vector<std::string> shards;
    if (file_exists(dir + "model.safetensors")) shards = {dir + "model.safetensors"};
    else shards = {dir + "model-00001-of-00002.safetensors", dir + "model-00002-of-00002.safetensors"};
    size_t n = 0;
    for (auto& s : shards) {
      SafetensorsFile f(s);
      for (auto& [name, e] : f.entries()) {
        TensorView v = f.get(name);
        EXPECT_EQ(v.nbytes(), e.end - e.begin) << name;
        ++n;
      }
    }
    EXPECT_GT(n, 10u) << model;
  }
}
