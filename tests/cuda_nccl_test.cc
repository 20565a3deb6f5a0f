// The CUDA backend's collectives through NCCL at world size 1 (a communicator of one rank, which
// every GPU machine can make): all_reduce is the identity and all_gather gives Backend::all_gather's
// layout, called alone and inside a recorded step (captured as a CUDA graph, then replayed); the
// layout's reordering for several ranks on its own. Skips without a GPU or without NCCL.
#include <gtest/gtest.h>

#ifdef DSV3_HAVE_CUDA

#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "dist/comm.h"

using namespace dsv3;

namespace {

#define REQUIRE_NCCL()                                                                     \
  do {                                                                                     \
    std::string why_;                                                                      \
    if (!cuda::device_available(&why_)) GTEST_SKIP() << why_;                              \
    if (!cuda::nccl_built()) GTEST_SKIP() << "built without NCCL (no nccl.h / libnccl)";   \
  } while (0)

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> d(-2.f, 2.f);
  std::vector<float> v(n);
  for (float& x : v) x = d(g);
  return v;
}

// A device buffer of `be` (n floats), optionally filled from the host.
struct DevBuf {
  Backend& be;
  size_t n;
  float* p;
  DevBuf(Backend& b, size_t count) : be(b), n(count), p(b.alloc(count)) {}
  ~DevBuf() { be.release(p); }
  void put(const std::vector<float>& h) { be.upload(p, h.data(), n); }
  std::vector<float> get() const {
    std::vector<float> h(n);
    be.download(h.data(), p, n);
    return h;
  }
};

TEST(CudaNccl, WorldOfOneCollectives) {
  REQUIRE_NCCL();
  auto cuda = make_cuda_backend(CudaOptions{});
  auto comm = make_single_comm();
  const int64_t d = 37;
  for (int64_t rows : {1, 3}) {
    const std::vector<float> x = random_floats(size_t(rows * d), uint32_t(rows));
    DevBuf xd(*cuda, x.size()), yd(*cuda, x.size());
    xd.put(x);
    cuda->all_reduce(*comm, xd.p, rows * d);  // [rows, d] summed over one rank
    EXPECT_EQ(xd.get(), x) << "all_reduce, rows " << rows;
    cuda->all_gather(*comm, xd.p, rows, d, yd.p);  // [rows, 1 * d]
    EXPECT_EQ(yd.get(), x) << "all_gather, rows " << rows;
  }
}

// y [rows, P * d] from parts [P, rows, d]: rank p's row r at columns [p * d, (p + 1) * d) of row r.
TEST(CudaNccl, GatherLayout) {
  REQUIRE_NCCL();
  auto cuda = make_cuda_backend(CudaOptions{});
  for (int64_t P : {1, 3}) {
    for (int64_t rows : {1, 4}) {
      const int64_t d = 5;
      std::vector<float> parts(size_t(P * rows * d));
      for (int64_t p = 0; p < P; ++p)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < d; ++c) parts[size_t((p * rows + r) * d + c)] = float(p * 1000 + r * 10 + c);
      DevBuf pd(*cuda, parts.size()), yd(*cuda, parts.size());
      pd.put(parts);
      cuda::gather_layout_for_test(*cuda, pd.p, P, rows, d, yd.p);
      const std::vector<float> y = yd.get();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t p = 0; p < P; ++p)
          for (int64_t c = 0; c < d; ++c)
            ASSERT_EQ(y[size_t(r * P * d + p * d + c)], float(p * 1000 + r * 10 + c))
                << "P " << P << " rows " << rows << " row " << r << " part " << p << " column " << c;
    }
  }
}

// A step of "b += a; all_reduce(b); y = all_gather(b)" run four times with new inputs: the first
// run launches, the second is recorded with the NCCL calls inside the CUDA graph, the others replay
// it; every run's y is b + a.
TEST(CudaNccl, CollectivesInARecordedStep) {
  REQUIRE_NCCL();
  CudaOptions o;
  o.graphs = true;
  auto cuda = make_cuda_backend(o);
  auto comm = make_single_comm();
  const int64_t d = 64;
  for (int64_t rows : {1, 3}) {
    DevBuf a(*cuda, size_t(rows * d)), b(*cuda, size_t(rows * d)), y(*cuda, size_t(rows * d));
    StepGraph g;
    g.n = 1;
    g.values = {{"a", a.p, rows, d, d}, {"b", b.p, rows, d, d}, {"y", y.p, rows, d, d}};
    auto op = [&](OpKind k, const char* name, int in, int out) {
      Op x;
      x.kind = k, x.name = name, x.in = in, x.out = out, x.comm = comm.get();
      g.ops.push_back(x);
      g.nodes.push_back({Fusion::kNone, int(g.ops.size()) - 1, 1, false});
    };
    op(OpKind::kAdd, "add", 0, 1);              // b [rows, d] += a
    op(OpKind::kAllReduce, "all_reduce", -1, 1);  // b summed over the ranks
    op(OpKind::kAllGather, "all_gather", 1, 2);   // y [rows, 1 * d] = every rank's b
    std::vector<int32_t> tokens = {0};
    std::vector<TokenPos> pos = {{0, 0}};
    Step s;
    s.tokens = tokens.data(), s.pos = pos.data(), s.n = 1;
    for (int run = 0; run < 4; ++run) {
      const std::vector<float> av = random_floats(a.n, uint32_t(10 * rows + run)),
                               bv = random_floats(b.n, uint32_t(100 * rows + run));
      a.put(av);
      b.put(bv);
      cuda->run(g, s);
      const std::vector<float> got = y.get();
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_EQ(got[i], bv[i] + av[i]) << "rows " << rows << " run " << run << " at " << i;
    }
    // (one: releasing the last iteration's buffers forgot its recorded step)
    EXPECT_EQ(cuda::graphs_recorded(*cuda), 1) << "rows " << rows << ": the step was not recorded";
  }
}

}  // namespace

#else  // !DSV3_HAVE_CUDA

TEST(CudaNccl, NotBuilt) { GTEST_SKIP() << "built without CUDA (-DDSV3_CUDA=OFF or no nvcc)"; }

#endif
