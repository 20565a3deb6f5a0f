// Scalar conversions (dtype.h) against exhaustive or independent definitions.
#include <gtest/gtest.h>

#include <cmath>

#include "core/dtype.h"
#include "core/thread_pool.h"

using namespace dsv3;

TEST(DType, E4m3RoundTripsEveryCode) {
  for (int b = 0; b < 256; ++b) {
    float v = e4m3_to_f32(uint8_t(b));
    if (std::isnan(v)) continue;
    uint8_t back = f32_to_e4m3(v);
    if (v == 0.f) EXPECT_EQ(back & 0x7f, 0);
    else EXPECT_EQ(back, b) << "code " << b << " value " << v;
  }
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.f);
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.f, -9));
}

TEST(DType, E4m3RoundsHalfToEvenAndSaturates) {
  // Between every pair of adjacent positive codes, the midpoint goes to the even code.
  for (int b = 0; b < 0x7e; ++b) {
    float lo = e4m3_to_f32(uint8_t(b)), hi = e4m3_to_f32(uint8_t(b + 1));
    float mid = (lo + hi) / 2;
    EXPECT_EQ(f32_to_e4m3(mid), (b % 2 == 0) ? b : b + 1) << "between codes " << b << " and " << b + 1;
    EXPECT_EQ(f32_to_e4m3(std::nextafter(mid, 0.f)), b);
    EXPECT_EQ(f32_to_e4m3(std::nextafter(mid, 1e9f)), b + 1);
    EXPECT_EQ(f32_to_e4m3(-std::nextafter(mid, 1e9f)), 0x80 | (b + 1));
  }
  EXPECT_EQ(f32_to_e4m3(1e6f), 0x7e);
  EXPECT_EQ(f32_to_e4m3(-500.f), 0xfe);
}

TEST(DType, Bf16RoundsHalfToEven) {
  EXPECT_EQ(f32_to_bf16(1.f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f808000)), 0x3f80);  // tie, even stays
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f818000)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f808001)), 0x3f81);
  for (uint32_t h = 0; h < 0x10000; h += 7) {
    float v = bf16_to_f32(uint16_t(h));
    if (!std::isnan(v)) {
      EXPECT_EQ(f32_to_bf16(v), h);
    }
  }
}

TEST(DType, F16RoundTripsEveryCode) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float v = f16_to_f32(uint16_t(h));
    if (std::isnan(v)) continue;
    EXPECT_EQ(f32_to_f16(v), h) << h;
  }
}

TEST(ThreadPool, CoversEveryIndexOnceForOddSizes) {
  for (int threads : {1, 2, 3, 5}) {
    ThreadPool pool(threads);
    for (int64_t n : {1, 2, 3, 7, 100, 1001}) {
      std::vector<int> hits(size_t(n), 0);
      pool.parallel_for(n, [&](int64_t b, int64_t e, int) {
        for (int64_t i = b; i < e; ++i) hits[size_t(i)]++;
      });
      for (auto h : hits) ASSERT_EQ(h, 1);
    }
  }
}

TEST(ThreadPool, PropagatesExceptionsFromWorkers) {
  ThreadPool pool(3);
  EXPECT_THROW(pool.parallel_for(9, [](int64_t b, int64_t, int) {
    if (b > 0) throw std::runtime_error("boom");
  }), std::runtime_error);
  int sum = 0;  // still usable afterwards
  pool.parallel_for(1, [&](int64_t, int64_t, int) { sum = 1; });
  EXPECT_EQ(sum, 1);
}
