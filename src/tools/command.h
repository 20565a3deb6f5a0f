// Subcommands of the `dsv3` binary register themselves here; main() dispatches by name.
#pragma once
#include <map>
#include <string>
#include <vector>

namespace dsv3 {

// Parsed `--key value` options and `--flag`s. Unknown options are errors (named in the message).
class Args {
 public:
  // `flags` take no value; `options` take one. argv[0] is the subcommand name.
  Args(int argc, char** argv, const std::vector<std::string>& options,
       const std::vector<std::string>& flags = {});
  bool has(const std::string& k) const { return values_.count(k) || flags_.count(k); }
  std::string get(const std::string& k, const std::string& dflt = "") const;
  std::string require(const std::string& k) const;  // throws Error "missing --k"
  long get_int(const std::string& k, long dflt) const;
  double get_float(const std::string& k, double dflt) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> flags_;
  std::vector<std::string> positional_;
};

using CommandFn = int (*)(int argc, char** argv);
struct CommandInfo {
  const char* name;
  const char* usage;  // one line: "--model DIR [--json]: what it does"
  CommandFn fn;
};
bool register_command(const CommandInfo& c);
const std::map<std::string, CommandInfo>& commands();

}  // namespace dsv3

// In a src/tools/cmd_*.cc: DSV3_COMMAND(logits, "--model DIR ...: ...", run_logits)
#define DSV3_COMMAND(name, usage, fn) \
  static const bool dsv3_registered_##name = ::dsv3::register_command({#name, usage, fn})
