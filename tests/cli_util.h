// Running the built `dsv3` binary from a test, as a user would.
#pragma once
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "golden_util.h"
#include "io/mmap_file.h"

namespace dsv3::testing_util {

struct CliRun {
  int rc;  // the exit status; -1 when the process did not exit normally
  std::string out, err;
};

// Runs `dsv3 <args>` (`args` already shell-quoted) with `input` on stdin, capturing stdout and
// stderr. The scratch files are removed afterwards.
inline CliRun run_dsv3(const std::string& args, const std::string& input = "") {
  static int counter = 0;
  const std::string base = tmp_path("cli" + std::to_string(counter++));
  const std::string in = base + ".in", out = base + ".out", err = base + ".err";
  std::ofstream(in, std::ios::binary) << input;
  const std::string cmd =
      std::string("'") + DSV3_BINARY + "' " + args + " <'" + in + "' >'" + out + "' 2>'" + err + "'";
  const int status = std::system(cmd.c_str());
  CliRun r{WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_text_file(out), read_text_file(err)};
  for (const std::string* f : {&in, &out, &err}) std::remove(f->c_str());
  return r;
}

}  // namespace dsv3::testing_util
