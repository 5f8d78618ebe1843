// A crash in a test prints the stack (addresses resolvable with addr2line against the test
// binary) before the process dies, so a segfault on a machine without a debugger is not silent.
#include <execinfo.h>
#include <unistd.h>

#include <csignal>

namespace {

extern "C" void print_stack_and_die(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  const char msg[] = "\n*** fatal signal in nibble_tests; stack:\n";
  (void)!write(STDERR_FILENO, msg, sizeof msg - 1);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

const bool installed = [] {
  std::signal(SIGSEGV, print_stack_and_die);
  std::signal(SIGBUS, print_stack_and_die);
  std::signal(SIGFPE, print_stack_and_die);
  std::signal(SIGABRT, print_stack_and_die);
  return true;
}();

}  // namespace
