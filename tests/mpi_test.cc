// Several ranks under mpirun (OpenMPI, CPU ranks): the golden cases' logits split over 2 and 4
// ranks (oversubscribed on a 2-core machine) equal one process's and pass the golden bar, both
// attention modes; greedy generation over 2 ranks gives one process's ids; a rank killed or
// stopped mid-run ends the job with a message naming it; ranks disagreeing on the config, or one
// without the checkpoint, fail at start saying which and why.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "dist/comm.h"
#include "golden_util.h"
#include "io/mmap_file.h"
#include "io/safetensors.h"

namespace dsv3 {
namespace {

using namespace testing_util;

bool sanitized() {
#if defined(__SANITIZE_ADDRESS__)
  return true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  return true;
#else
  return false;
#endif
#else
  return false;
#endif
}

#define REQUIRE_MPI()                                                                           \
  do {                                                                                          \
    if (sanitized()) GTEST_SKIP() << "OpenMPI's own allocations read as leaks under ASan";       \
    if (!mpi_built()) GTEST_SKIP() << "built without MPI (-DDSV3_MPI=OFF or no libopenmpi-dev)"; \
  } while (0)

bool mpi_built() {
#ifdef DSV3_HAVE_MPI
  return true;
#else
  return false;
#endif
}

// mpirun as CI runs it: as root if need be, oversubscribed, no core binding, shared memory
// without cross-memory attach (not allowed in many containers).
std::string mpirun(int np) {
  return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none "
         "mpirun --oversubscribe --bind-to none -np " +
         std::to_string(np) + " ";
}

struct Shell {
  int rc;
  std::string err;
};
Shell sh(const std::string& cmd) {
  const std::string err = tmp_path("mpi_err.txt");
  const int st = std::system((cmd + " 2>" + err).c_str());
  Shell r{WIFEXITED(st) ? WEXITSTATUS(st) : -1, read_text_file(err)};
  std::remove(err.c_str());
  return r;
}

// The golden case's calls replayed by `dsv3 logits` (the ref backend), under `launcher`.
std::string logits(const std::string& c, const std::string& attn, const std::string& launcher) {
  const std::string out = tmp_path("mpi_" + c + "_" + attn + std::to_string(launcher.size()) + ".safetensors");
  const std::string cmd = launcher + DSV3_BINARY + " logits --model " + case_dir(c) + "/hf --calls " + case_dir(c) +
                          "/golden.safetensors --out " + out + " --attn " + attn + " --threads 1 >/dev/null";
  const Shell r = sh(cmd);
  EXPECT_EQ(r.rc, 0) << cmd << "\n" << r.err;
  return out;
}

TEST(Mpi, GoldenLogitsOverTwoAndFourRanksEqualOneProcess) {
  REQUIRE_MPI();
  for (const std::string& c : golden_cases())
    for (const std::string attn : {"absorb", "naive"}) {
      const std::string one = logits(c, attn, "");
      SafetensorsFile want(one), golden(case_dir(c) + "/golden.safetensors");
      for (int np : {2, 4}) {
        const std::string many = logits(c, attn, mpirun(np));
        SafetensorsFile got(many);
        int steps = 0;
        double worst = 0;
        for (auto& [name, e] : want.entries()) {
          TensorView a = got.get(name), b = want.get(name);
          ASSERT_EQ(a.shape, b.shape) << name;
          const size_t n = size_t(a.numel());
          const double err = rel_l2(a.as<float>(), b.as<float>(), n);
          worst = std::max(worst, err);
          EXPECT_LE(err, 1e-5) << c << " " << attn << " " << np << " ranks " << name;
          // and the golden bar, row by row
          const std::string key = name.substr(0, name.size() - 7) + ".logits_fp32";
          TensorView g = golden.get(key);
          const int V = int(a.dim(1));
          for (int64_t r = 0; r < a.dim(0); ++r) {
            EXPECT_LE(rel_l2(a.as<float>() + r * V, g.as<float>() + r * V, size_t(V)), 1e-3) << key << " row " << r;
            EXPECT_EQ(argmax(a.as<float>() + r * V, V), argmax(g.as<float>() + r * V, V)) << key << " row " << r;
          }
          ++steps;
        }
        EXPECT_GE(steps, 37);
        std::printf("%s %s, %d ranks: worst relative L2 against one process %.3g\n", c.c_str(), attn.c_str(), np,
                    worst);
        std::remove(many.c_str());
      }
      std::remove(one.c_str());
    }
}

// The reference's converted layout for N ranks (dsv3 convert --model-parallel N), each rank
// reading only its own file: the one-process logits of the Hugging Face layout.
TEST(Mpi, ConvertedFilesForNRanksGiveOneProcessLogits) {
  REQUIRE_MPI();
  for (const std::string c : {"v2lite_bf16", "v2_groups_bf16"}) {
    const std::string one = logits(c, "absorb", "");
    SafetensorsFile want(one);
    for (int np : {2, 4}) {
      const std::string dir = tmp_path("mpi_conv_" + c + std::to_string(np));
      std::filesystem::remove_all(dir);
      const int experts = c == "v2lite_bf16" ? 8 : 16;
      Shell r = sh(std::string(DSV3_BINARY) + " convert --hf-ckpt-path " + case_dir(c) + "/hf --save-path " + dir +
                   " --n-experts " + std::to_string(experts) + " --model-parallel " + std::to_string(np));
      ASSERT_EQ(r.rc, 0) << r.err;
      const std::string out = tmp_path("mpi_conv_out.safetensors");
      r = sh(mpirun(np) + DSV3_BINARY + " logits --model " + dir + " --config " + case_dir(c) +
             "/ref_config.json --calls " + case_dir(c) + "/golden.safetensors --out " + out + " --threads 1 >/dev/null");
      ASSERT_EQ(r.rc, 0) << r.err;
      SafetensorsFile got(out);
      for (auto& [name, e] : want.entries()) {
        TensorView a = got.get(name), b = want.get(name);
        EXPECT_LE(rel_l2(a.as<float>(), b.as<float>(), size_t(a.numel())), 1e-5) << c << " " << np << " " << name;
      }
      std::filesystem::remove_all(dir);
      std::remove(out.c_str());
    }
    std::remove(one.c_str());
  }
}

TEST(Mpi, GreedyGenerationOverTwoRanksGivesOneProcessIds) {
  REQUIRE_MPI();
  const std::string ids = tmp_path("mpi_prompts.txt");
  std::ofstream(ids) << "5 9 2 7\n11 3\n4 4 8 1 6 2 9\n";
  auto run = [&](const std::string& launcher) {
    const std::string out = tmp_path("mpi_gen.json");
    const std::string cmd = launcher + DSV3_BINARY + " generate --model " + case_dir("v3_fp8") + "/hf --input-ids " +
                            ids + " --json --backend cpu --threads 1 --temperature 0 --max-new-tokens 12 >" + out;
    const Shell r = sh(cmd);
    EXPECT_EQ(r.rc, 0) << cmd << "\n" << r.err;
    return read_text_file(out);
  };
  const std::string one = run(""), two = run(mpirun(2));
  EXPECT_NE(one.find("completion_ids"), std::string::npos);
  EXPECT_EQ(two, one);
}

// Rank `rank`'s process, a child of mpirun `launcher_pid` (its environment says its rank).
pid_t rank_pid(pid_t launcher_pid, int rank) {
  const std::string want = "OMPI_COMM_WORLD_RANK=" + std::to_string(rank);
  for (const auto& d : std::filesystem::directory_iterator("/proc")) {
    const std::string name = d.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream st(d.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(st)), {});
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    int ppid = 0;
    char state = 0;
    if (std::sscanf(stat.c_str() + close + 1, " %c %d", &state, &ppid) != 2 || ppid != launcher_pid) continue;
    std::ifstream env(d.path() / "environ");
    std::string e((std::istreambuf_iterator<char>(env)), {});
    for (size_t p = 0; p < e.size(); p = e.find('\0', p) + 1) {
      if (e.compare(p, want.size(), want) == 0 && (p + want.size() == e.size() || e[p + want.size()] == '\0'))
        return pid_t(std::stoi(name));
      if (e.find('\0', p) == std::string::npos) break;
    }
  }
  return -1;
}

// A long greedy generation over 2 ranks, started in the background; `act` is done to rank 1 once
// it runs; returns mpirun's exit code, its stderr and how long it took to end after `act`.
struct Ended {
  int rc;
  std::string err;
  double seconds;
};
Ended disturb(int sig, const std::string& env) {
  const std::string err = tmp_path("mpi_fault.txt"), ids = tmp_path("mpi_fault_ids.txt");
  {
    std::ofstream f(ids);  // a long run: many prompts, one at a time
    for (int i = 0; i < 3000; ++i) f << 5 + i % 400 << " 9 2 7\n";
  }
  const pid_t launcher = fork();
  if (launcher == 0) {
    const std::string cmd = "exec env " + env + " " + mpirun(2) + DSV3_BINARY + " generate --model " +
                            case_dir("v3_fp8") + "/hf --input-ids " + ids +
                            " --json --backend cpu --threads 1 --temperature 0 --ignore-eos --max-new-tokens 200 "
                            "--max-seqs 1 >/dev/null 2>" + err;
    execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
    _exit(127);
  }
  pid_t victim = -1;
  for (int i = 0; i < 200 && victim < 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    victim = rank_pid(launcher, 1);
  }
  EXPECT_GT(victim, 0) << "rank 1 never appeared";
  std::this_thread::sleep_for(std::chrono::seconds(2));  // (loaded, generating)
  const auto t0 = std::chrono::steady_clock::now();
  if (victim > 0) kill(victim, sig);
  int st = 0;
  for (int i = 0; i < 1200; ++i) {  // at most 60 s
    if (waitpid(launcher, &st, WNOHANG) == launcher) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (i == 1199) {
      kill(launcher, SIGKILL);
      if (victim > 0) kill(victim, SIGKILL);
      waitpid(launcher, &st, 0);
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (victim > 0) kill(victim, SIGKILL);  // (a stopped one left behind)
  Ended e{WIFEXITED(st) ? WEXITSTATUS(st) : -1, read_text_file(err), s};
  std::remove(err.c_str());
  return e;
}

TEST(Mpi, AKilledRankEndsTheOthersWithAMessageNamingIt) {
  REQUIRE_MPI();
  const Ended e = disturb(SIGKILL, "");
  EXPECT_NE(e.rc, 0);
  EXPECT_LT(e.seconds, 30);
  EXPECT_NE(e.err.find("rank 1"), std::string::npos) << e.err;
}

TEST(Mpi, AHungRankEndsTheOthersWithinTheTimeout) {
  REQUIRE_MPI();
  const Ended e = disturb(SIGSTOP, "DSV3_COMM_TIMEOUT=3");
  EXPECT_NE(e.rc, 0);
  EXPECT_LT(e.seconds, 30);
  EXPECT_NE(e.err.find("rank 0 of 2"), std::string::npos) << e.err;
  EXPECT_NE(e.err.find("made no progress for"), std::string::npos) << e.err;
}

TEST(Mpi, RanksDisagreeingOrMissingTheCheckpointFailAtStart) {
  REQUIRE_MPI();
  const std::string base = std::string(DSV3_BINARY) + " logits --calls " + case_dir("v3_fp8") +
                           "/golden.safetensors --out " + tmp_path("mpi_never.safetensors") + " --threads 1 --model ";
  const std::string launch = "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
                             "OMPI_MCA_btl_vader_single_copy_mechanism=none mpirun --oversubscribe --bind-to none ";
  // Rank 1 with another model (an MPMD launch): the fields that differ, named.
  Shell r = sh(launch + "-np 1 " + base + case_dir("v3_fp8") + "/hf : -np 1 " + base + case_dir("v2lite_bf16") + "/hf");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("rank 1: its config (" + case_dir("v2lite_bf16") + "/hf/config.json) differs from rank 0's"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("n_routed_experts 8 (rank 0: 16)"), std::string::npos) << r.err;
  // Rank 1 without the checkpoint.
  r = sh(launch + "-np 1 " + base + case_dir("v3_fp8") + "/hf : -np 1 " + base + "/nonexistent/model");
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.err.find("rank 1 of 2: /nonexistent/model"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("rank 0 of 2: another rank could not open the model"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(tmp_path("mpi_never.safetensors")));
}

// What a rank reads from mpirun's environment: its rank on the node (a CUDA rank's GPU) and the
// collectives' timeout, with a message naming the variable for a bad value.
TEST(Comm, LocalRankAndTimeoutFromTheEnvironment) {
  EXPECT_EQ(parse_local_rank(nullptr), -1);
  EXPECT_EQ(parse_local_rank("0"), 0);
  EXPECT_EQ(parse_local_rank("7"), 7);
  for (const char* bad : {"", "-1", "x", "3x"}) {
    try {
      parse_local_rank(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("OMPI_COMM_WORLD_LOCAL_RANK"), std::string::npos) << e.what();
    }
  }
  const char* was = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  const std::string saved = was ? was : "";
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3", 1);
  EXPECT_EQ(local_rank(), 3);
  unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
  EXPECT_EQ(local_rank(), -1);
  if (was) setenv("OMPI_COMM_WORLD_LOCAL_RANK", saved.c_str(), 1);

  const char* t = std::getenv("DSV3_COMM_TIMEOUT");
  const std::string saved_t = t ? t : "";
  unsetenv("DSV3_COMM_TIMEOUT");
  EXPECT_EQ(comm_timeout_s(), 60);
  setenv("DSV3_COMM_TIMEOUT", "2.5", 1);
  EXPECT_EQ(comm_timeout_s(), 2.5);
  setenv("DSV3_COMM_TIMEOUT", "0", 1);
  EXPECT_THROW(comm_timeout_s(), Error);
  if (t) setenv("DSV3_COMM_TIMEOUT", saved_t.c_str(), 1);
  else unsetenv("DSV3_COMM_TIMEOUT");
}

}  // namespace
}  // namespace dsv3
