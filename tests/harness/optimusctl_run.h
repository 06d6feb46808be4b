// Runs the real optimusctl binary (a data dependency of the test:
// //cli:optimusctl) as an operator would, capturing its exit code, stdout
// and stderr. For integration tests of the CLI.
#ifndef OPTIMUS_TESTS_HARNESS_OPTIMUSCTL_RUN_H_
#define OPTIMUS_TESTS_HARNESS_OPTIMUSCTL_RUN_H_

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace optimus {
namespace harness {

struct CliRun {
  int exit_code = -1;  // -1: it could not be started, or did not exit.
  std::string out, err;
};

// `optimusctl ARGS` through the shell, with `env` ("NAME=VALUE ...") in its
// environment.
inline CliRun RunOptimusctl(const std::string& args, const std::string& env = "") {
  const std::string binary = absl::StrCat(std::getenv("TEST_SRCDIR"), "/optimus/cli/optimusctl");
  const std::string err_path = absl::StrCat(std::getenv("TEST_TMPDIR"), "/optimusctl_stderr.txt");
  const std::string cmd =
      absl::StrCat(env.empty() ? "" : "env " + env + " ", binary, " ", args, " 2>", err_path);
  CliRun r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.out.append(buf, n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream err(err_path);
  std::stringstream ss;
  ss << err.rdbuf();
  r.err = ss.str();
  return r;
}

}  // namespace harness
}  // namespace optimus

#endif  // OPTIMUS_TESTS_HARNESS_OPTIMUSCTL_RUN_H_
