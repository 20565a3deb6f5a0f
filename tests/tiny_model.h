// The tiny synthetic model (seed 1, FP8, the real tokenizer) for tests that run a model, made
// once per build of the tests and shared by their processes (ctest runs each test in its own):
// it lives in ${TMPDIR}/dsv3_test_tiny_<uid>/<build>/, where <build> names this test binary
// (its mtime and size). Each process holds a shared lock on the folder it uses; a folder of
// another build that no process holds is removed when a new one is made.
#pragma once
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "tools/synth.h"
#include "text/tokenizer.h"

namespace server_test {

namespace fs = std::filesystem;

// Removes the model folders of other builds that no process is using.
inline void remove_unused_models(const fs::path& root, const fs::path& keep) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    if (!e.is_directory() || e.path() == keep) continue;
    const int fd = ::open((e.path() / "lock").c_str(), O_RDWR);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) fs::remove_all(e.path(), ec);
    ::close(fd);
  }
}

inline const std::string& tiny_model() {
  static const std::string dir = [] {
    struct stat st {};
    ::stat("/proc/self/exe", &st);
    const fs::path root = fs::temp_directory_path() / ("dsv3_test_tiny_" + std::to_string(::getuid()));
    const fs::path here = root / (std::to_string(st.st_mtime) + "_" + std::to_string(st.st_size));
    fs::create_directories(here);
    // Held for the life of the process (the descriptor is never closed): shared while in use,
    // exclusive while the model is made.
    const int lock = ::open((here / "lock").c_str(), O_CREAT | O_RDWR, 0600);
    ::flock(lock, LOCK_EX);
    if (!fs::exists(here / "tiny" / "config.json")) {
      remove_unused_models(root, here);
      dsv3::SynthOptions o;
      o.shape = "tiny";
      o.dtype = "fp8";
      o.out_dir = (here / "tiny").string();
      o.seed = 1;
      o.fsync = false;
      o.force = true;
      o.tokenizer_dir = dsv3::find_tokenizer_dir("");
      dsv3::synthesize(o);
    }
    ::flock(lock, LOCK_SH);
    return (here / "tiny").string();
  }();
  return dir;
}

}  // namespace server_test
