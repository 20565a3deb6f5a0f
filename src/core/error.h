// Errors: dsv3::Error for bad input from outside (files, configs, CLI, requests), with a message
// that names what was wrong; DSV3_CHECK for internal invariants (always on, with file:line).
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace dsv3 {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {
inline void cat(std::ostringstream&) {}
template <class T, class... R>
void cat(std::ostringstream& os, const T& t, const R&... r) {
  os << t;
  cat(os, r...);
}
}  // namespace detail

// Builds a message from any streamable parts: str("tensor ", name, " has shape ", n).
template <class... A>
std::string str(const A&... a) {
  std::ostringstream os;
  detail::cat(os, a...);
  return os.str();
}

template <class... A>
[[noreturn]] void fail(const A&... a) {
  throw Error(str(a...));
}

}  // namespace dsv3

#define DSV3_CHECK(cond, ...)                                                                   \
  do {                                                                                          \
    if (!(cond))                                                                                \
      throw ::dsv3::Error(::dsv3::str(__FILE__, ":", __LINE__, ": internal check failed: " #cond \
                                      " ",                                                      \
                                      ##__VA_ARGS__));                                          \
  } while (0)
