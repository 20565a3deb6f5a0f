// Where host weights live (backend/host_weights.h, --weight-memory): the copy into anonymous
// memory holds exactly the checkpoint's bytes, the model computes the same logits from it, the
// automatic choice follows free memory, and pinning is what /proc says.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/host_weights.h"
#include "golden_util.h"
#include "io/checkpoint.h"
#include "io/mmap_file.h"
#include "runtime/model.h"

using namespace dsv3;
using namespace dsv3::testing_util;

namespace {

// Every non-empty tensor's bytes, in for_each_tensor's order.
std::vector<std::string> snapshot(ModelWeights& w) {
  std::vector<std::string> v;
  for_each_tensor(w, [&](TensorView& t, TensorRole) {
    if (!t.empty()) v.emplace_back(static_cast<const char*>(t.data), t.nbytes());
  });
  return v;
}

int64_t vm_locked_bytes() {  // /proc/self/status VmLck
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("VmLck:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;
  return -1;
}

int64_t rss_file_bytes() {  // /proc/self/status RssFile
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("RssFile:", 0) == 0) return std::atoll(line.c_str() + 8) * 1024;
  return -1;
}

// The copy drops the checkpoint's pages as it goes: inside a live file mapping the pages leave
// the resident set and read back the same; heap memory is never touched.
TEST(HostWeights, ReleasingPagesDropsOnlyFileMappings) {
  std::vector<uint8_t> heap(3 * 4096, 7);
  EXPECT_FALSE(release_mapped_pages(heap.data() + 4096, 4096));
  for (uint8_t b : heap) ASSERT_EQ(b, 7);

  MmapFile f(case_dir("v3_fp8") + "/hf/model-00001-of-00002.safetensors");
  ASSERT_GT(f.size(), size_t(1) << 20);
  const std::string before(reinterpret_cast<const char*>(f.data()), f.size());  // every page mapped in
  const int64_t rss = rss_file_bytes();
  EXPECT_TRUE(release_mapped_pages(f.data() + 100, f.size() - 100));
  EXPECT_LT(rss_file_bytes(), rss - int64_t(f.size()) / 2) << "the file's pages should have left the resident set";
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(f.data()), f.size()), before);
  EXPECT_FALSE(release_mapped_pages(f.data() + f.size() - 10, 20)) << "a range past the mapping's end";
}

// A rank's shard holds row-parallel slices copied out of the file (w.owned) beside views into
// the mapping: the copy takes both, byte for byte, into one arena, and frees the slices.
TEST(HostWeights, CopyHoldsEveryTensorsBytesIncludingOwnedSlices) {
  for (const char* c : {"v3_fp8", "v2lite_bf16"}) {
    auto ck = Checkpoint::open(case_dir(c) + "/hf");
    ModelWeights w = load_weights(*ck, {1, 2});
    ASSERT_FALSE(w.owned.empty()) << c << ": rank 1 of 2 should own its row-parallel slices";
    const std::vector<std::string> before = snapshot(w);
    HostArena arena;
    WeightMemory m;
    m.mode = WeightMemory::kCopy;
    const WeightPlacement p = place_host_weights(w, m, &arena);
    EXPECT_TRUE(p.copied && p.off_checkpoint) << p.note;
    EXPECT_NE(p.note.find("copied into anonymous memory"), std::string::npos) << p.note;
    EXPECT_TRUE(w.owned.empty());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(arena.data()) % (2u << 20), 0u);
    int in_arena = 0, n = 0;
    for_each_tensor(w, [&](TensorView& t, TensorRole) {
      if (t.empty()) return;
      ++n;
      const uint8_t* d = static_cast<const uint8_t*>(t.data);
      in_arena += d >= arena.data() && d + t.nbytes() <= arena.data() + arena.size();
    });
    EXPECT_EQ(in_arena, n) << c;
    EXPECT_EQ(snapshot(w), before) << c;
  }
}

TEST(HostWeights, MapLeavesTheViewsWhereTheyAre) {
  auto ck = Checkpoint::open(case_dir("v3_fp8") + "/hf");
  ModelWeights w = load_weights(*ck);
  const void* embed = w.embed.data;
  HostArena arena;
  WeightMemory m;
  m.mode = WeightMemory::kMap;
  const WeightPlacement p = place_host_weights(w, m, &arena);
  EXPECT_FALSE(p.copied || p.off_checkpoint);
  EXPECT_EQ(w.embed.data, embed);
  EXPECT_EQ(arena.data(), nullptr);
  EXPECT_NE(p.note.find("read in place"), std::string::npos) << p.note;
}

TEST(HostWeights, AutoCopiesOnlyWhatFitsBesideWhatMustStayFree) {
  WeightMemory m;  // kAuto
  m.keep_free = 2'000'000'000;
  EXPECT_TRUE(weights_copied(m, 16'000'000'000, 18'000'000'000));
  EXPECT_FALSE(weights_copied(m, 16'000'000'001, 18'000'000'000));
  EXPECT_FALSE(weights_copied(m, 1, -1));  // free memory unknown: left in place
  m.mode = WeightMemory::kCopy;
  EXPECT_TRUE(weights_copied(m, 16'000'000'001, 18'000'000'000));
  m.mode = WeightMemory::kMap;
  EXPECT_FALSE(weights_copied(m, 1, 18'000'000'000));
}

// Ranks mpirun starts on one node share its memory.
TEST(HostWeights, AvailableMemoryIsSharedAmongTheNodesRanks) {
  const int64_t all = host_available_bytes();
  ASSERT_GT(all, 0);
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4", 1);
  const int64_t quarter = host_available_bytes();
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  EXPECT_GT(quarter, all / 4 * 0.8);
  EXPECT_LT(quarter, all / 4 * 1.2);
}

TEST(HostWeights, LockPinsTheCopyOrSaysWhyNot) {
  auto ck = Checkpoint::open(case_dir("v3_fp8") + "/hf");
  ModelWeights w = load_weights(*ck);
  const int64_t before = vm_locked_bytes();
  HostArena arena;
  WeightMemory m;
  m.mode = WeightMemory::kCopy;
  m.lock = true;
  const WeightPlacement p = place_host_weights(w, m, &arena);
  if (p.locked) {
    EXPECT_NE(p.note.find(", locked"), std::string::npos) << p.note;
#if defined(__SANITIZE_ADDRESS__)
    GTEST_SKIP() << "AddressSanitizer's mlock succeeds without pinning anything: VmLck cannot show the pin";
#endif
    EXPECT_GE(vm_locked_bytes() - before, int64_t(arena.size()) / 4096 * 4096) << p.note;
  } else {
    EXPECT_NE(p.note.find("warning: mlock refused"), std::string::npos) << p.note;
  }
}

// The whole model from the copy: the same logits, bit for bit, as from the checkpoint's pages.
TEST(HostWeights, CpuModelFromTheCopyGivesTheSameLogits) {
  for (const char* c : {"v3_fp8", "v2lite_bf16"}) {
    std::vector<std::vector<float>> logits;
    for (auto mode : {WeightMemory::kMap, WeightMemory::kCopy}) {
      ModelOptions opt;
      opt.max_seqs = 2;
      opt.weights.mode = mode;
      Model model(Checkpoint::open(case_dir(c) + "/hf"), make_cpu_backend(), opt);
      EXPECT_EQ(model.weights_placement().copied, mode == WeightMemory::kCopy) << model.weights_placement().note;
      const int V = model.args().vocab_size;
      std::vector<int32_t> toks = {1, 5, 9, 2, 7, 3, 11, 4};
      std::vector<float> out(size_t(2) * V);
      model.forward(toks.data(), 2, 4, 0, out.data());
      logits.push_back(out);
    }
    ASSERT_EQ(logits[0].size(), logits[1].size());
    EXPECT_EQ(std::memcmp(logits[0].data(), logits[1].data(), logits[0].size() * sizeof(float)), 0) << c;
  }
}

}  // namespace
