// Helpers of the tests of the checkpoint tools (dsv3 convert, dsv3 cast-bf16): scratch
// directories, what a directory holds, the golden cases' logits through `dsv3 logits`.
#pragma once
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "cli_util.h"
#include "golden_util.h"
#include "io/mmap_file.h"
#include "io/safetensors.h"

namespace dsv3::testing_util {

// A scratch path for a folder or file the test creates (or a command writes): nothing is there
// yet, and whatever is there when the test process ends is removed.
inline std::string fresh_dir(const std::string& name) {
  struct Scratch {
    std::vector<std::string> paths;
    ~Scratch() {
      std::error_code ec;
      for (auto& p : paths) std::filesystem::remove_all(p, ec);
    }
  };
  static Scratch scratch;
  const std::string d = tmp_path(name);
  std::filesystem::remove_all(d);
  scratch.paths.push_back(d);
  return d;
}

// Names of the entries directly in `dir` (files and folders), sorted.
inline std::set<std::string> dir_entries(const std::string& dir) {
  std::set<std::string> s;
  for (auto& e : std::filesystem::directory_iterator(dir)) s.insert(e.path().filename().string());
  return s;
}

// True when neither `out` nor any `out`.partial-* exists: a refused run left nothing behind.
inline bool nothing_at(const std::string& out) {
  namespace fs = std::filesystem;
  if (fs::exists(out)) return false;
  const fs::path p(out);
  if (!fs::exists(p.parent_path())) return true;
  for (auto& e : fs::directory_iterator(p.parent_path()))
    if (e.path().filename().string().rfind(p.filename().string() + ".partial-", 0) == 0) return false;
  return true;
}

inline nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(read_text_file(path)); }

// A copy of a golden case's hf/ directory at `dir`, to add files to or break.
inline void copy_hf(const std::string& golden_case, const std::string& dir) {
  std::filesystem::create_directories(dir);
  for (auto& e : std::filesystem::directory_iterator(case_dir(golden_case) + "/hf"))
    std::filesystem::copy_file(e.path(), dir + "/" + e.path().filename().string());
}

// `dsv3 logits` of a model over the golden case's forward calls (`extra`: --config, ...).
inline std::string golden_logits(const std::string& golden_case, const std::string& model, const std::string& extra,
                                 const std::string& out) {
  const CliRun r = run_dsv3("logits --model '" + model + "' " + extra + " --calls '" + case_dir(golden_case) +
                            "/golden.safetensors' --out '" + out + "'");
  EXPECT_EQ(r.rc, 0) << r.err;
  return out;
}

inline int golden_steps(const SafetensorsFile& g) { return std::atoi(g.metadata().at("steps").c_str()); }

inline std::string step_key(int s, const char* field) {
  char key[64];
  std::snprintf(key, sizeof key, "step%03d.%s", s, field);
  return key;
}

}  // namespace dsv3::testing_util
