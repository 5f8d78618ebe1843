// Errors a user can act on. Every failure that bad input can cause is reported as a nibble::Error
// carrying a message that names the file, the tensor or the field that was wrong; main() prints it
// and exits non-zero. Programming errors (broken invariants) use NIBBLE_ASSERT and abort.
#pragma once

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace nibble {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace nibble

// Checks a condition that depends on input (files, requests, flags); throws nibble::Error.
#define NIBBLE_CHECK(cond, ...)                \
  do {                                         \
    if (!(cond)) ::nibble::fail(__VA_ARGS__);  \
  } while (0)

// Checks an internal invariant; a failure is a bug in nibble, not in the input.
#define NIBBLE_ASSERT(cond)                                                              \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "nibble: internal error at %s:%d: %s\n", __FILE__, __LINE__, \
                   #cond);                                                               \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)
