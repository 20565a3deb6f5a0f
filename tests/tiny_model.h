// The tiny synthetic model (seed 1, FP8, the real tokenizer) for tests that run a model: made
// once in the temp folder, under a lock, by the first test process of a build of the tests and
// reused by the others (a stamp names the build).
#pragma once
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "model/synth.h"
#include "text/tokenizer.h"

namespace server_test {

inline const std::string& tiny_model() {
  static const std::string dir = [] {
    const std::string root = std::filesystem::temp_directory_path().string() + "/dsv3_test_tiny_" +
                             std::to_string(::getuid());
    std::filesystem::create_directories(root);
    struct stat st {};
    ::stat("/proc/self/exe", &st);
    const std::string stamp = std::to_string(st.st_mtime) + " " + std::to_string(st.st_size);
    const int lock = ::open((root + "/lock").c_str(), O_CREAT | O_RDWR, 0600);
    ::flock(lock, LOCK_EX);
    std::string have;
    std::getline(std::ifstream(root + "/stamp"), have);
    if (have != stamp || !std::filesystem::exists(root + "/tiny/config.json")) {
      dsv3::SynthOptions o;
      o.shape = "tiny";
      o.dtype = "fp8";
      o.out_dir = root + "/tiny";
      o.seed = 1;
      o.fsync = false;
      o.force = true;
      o.tokenizer_dir = dsv3::find_tokenizer_dir("");
      dsv3::synthesize(o);
      std::ofstream(root + "/stamp") << stamp << "\n";
    }
    ::flock(lock, LOCK_UN);
    ::close(lock);
    return root + "/tiny";
  }();
  return dir;
}

}  // namespace server_test
