// dsv3: one binary, many subcommands (see `dsv3 help`). Errors from bad input print one clear
// line and exit non-zero.
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "core/error.h"
#include "tools/command.h"

namespace dsv3 {

static std::map<std::string, CommandInfo>& registry() {
  static std::map<std::string, CommandInfo> r;
  return r;
}
bool register_command(const CommandInfo& c) {
  registry()[c.name] = c;
  return true;
}
const std::map<std::string, CommandInfo>& commands() { return registry(); }

Args::Args(int argc, char** argv, const std::vector<std::string>& options,
           const std::vector<std::string>& flags) {
  auto is_in = [](const std::vector<std::string>& v, const std::string& s) {
    for (auto& x : v)
      if (x == s) return true;
    return false;
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      std::string k = a.substr(2), v;
      bool inline_value = false;
      if (auto eq = k.find('='); eq != std::string::npos) {
        v = k.substr(eq + 1);
        k = k.substr(0, eq);
        inline_value = true;
      }
      if (is_in(flags, k)) {
        if (inline_value) fail("option --", k, " takes no value");
        flags_[k] = true;
      } else if (is_in(options, k)) {
        if (!inline_value) {
          if (i + 1 >= argc) fail("option --", k, " needs a value");
          v = argv[++i];
        }
        values_[k] = v;
      } else {
        fail("unknown option --", k, " for '", argv[0], "' (see dsv3 help)");
      }
    } else {
      positional_.push_back(a);
    }
  }
}

std::string Args::get(const std::string& k, const std::string& dflt) const {
  auto it = values_.find(k);
  return it == values_.end() ? dflt : it->second;
}
std::string Args::require(const std::string& k) const {
  auto it = values_.find(k);
  if (it == values_.end()) fail("missing required option --", k);
  return it->second;
}
long Args::get_int(const std::string& k, long dflt) const {
  auto it = values_.find(k);
  if (it == values_.end()) return dflt;
  char* end = nullptr;
  long v = std::strtol(it->second.c_str(), &end, 10);
  if (it->second.empty() || *end) fail("option --", k, " expects an integer, got '", it->second, "'");
  return v;
}
double Args::get_float(const std::string& k, double dflt) const {
  auto it = values_.find(k);
  if (it == values_.end()) return dflt;
  char* end = nullptr;
  double v = std::strtod(it->second.c_str(), &end);
  if (it->second.empty() || *end) fail("option --", k, " expects a number, got '", it->second, "'");
  return v;
}

}  // namespace dsv3

static void usage(FILE* f) {
  std::fprintf(f, "usage: dsv3 <command> [options]\n\ncommands:\n");
  for (auto& [name, c] : dsv3::commands()) std::fprintf(f, "  %-12s %s\n", name.c_str(), c.usage);
}

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "help" || std::string(argv[1]) == "--help") {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  auto it = dsv3::commands().find(argv[1]);
  if (it == dsv3::commands().end()) {
    std::fprintf(stderr, "dsv3: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
  }
  try {
    return it->second.fn(argc - 1, argv + 1);
  } catch (const dsv3::Error& e) {
    std::fprintf(stderr, "dsv3 %s: error: %s\n", argv[1], e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsv3 %s: error: %s\n", argv[1], e.what());
    return 1;
  }
}
