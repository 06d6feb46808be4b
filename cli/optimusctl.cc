// optimusctl: the operator's command line for an optimus cluster.
//   optimusctl [--coordinator=HOST:PORT] [--timeout_ms=N] status [--json]
// Exit codes: 0 success, 1 the command failed (e.g. coordinator
// unreachable), 2 usage error. Flags are parsed by hand so that every usage
// error, including an unknown flag, exits 2 with the usage text.
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/time/time.h"
#include "cli/status.h"

namespace {

constexpr char kUsage[] =
    "usage: optimusctl [--coordinator=HOST:PORT] [--timeout_ms=N] <command> [options]\n"
    "\n"
    "commands:\n"
    "  status [--json]   shards and jobs known to the coordinator\n"
    "\n"
    "flags:\n"
    "  --coordinator=HOST:PORT  coordinator address (default 127.0.0.1:7070)\n"
    "  --timeout_ms=N           give up on the coordinator after N ms (default 3000)\n"
    "  --json                   print one JSON object instead of tables\n";

int Usage(const std::string& error) {
  if (!error.empty()) std::cerr << "optimusctl: " << error << "\n\n";
  std::cerr << kUsage;
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string coordinator = "127.0.0.1:7070";
  int64_t timeout_ms = 3000;
  bool json = false;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help" || arg == "help") {
      std::cout << kUsage;
      return 0;
    }
    if (!absl::StartsWith(arg, "-")) {
      positional.push_back(arg);
      continue;
    }
    std::string name = arg, value;
    bool has_value = false;
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      has_value = true;
    }
    if (absl::StartsWith(name, "--")) name = name.substr(1);  // Accept -flag and --flag.
    auto take_value = [&]() -> bool {
      if (has_value) return true;
      if (i + 1 >= argc) return false;
      value = argv[++i];
      return true;
    };
    if (name == "-coordinator") {
      if (!take_value() || value.empty()) return Usage("--coordinator needs HOST:PORT");
      coordinator = value;
    } else if (name == "-timeout_ms") {
      if (!take_value() || !absl::SimpleAtoi(value, &timeout_ms) || timeout_ms <= 0) {
        return Usage("--timeout_ms needs a positive number of milliseconds");
      }
    } else if (name == "-json" && !has_value) {
      json = true;
    } else {
      return Usage("unknown flag " + arg);
    }
  }
  if (positional.empty()) return Usage("no command given");
  const std::string& command = positional[0];
  if (command != "status") return Usage("unknown command \"" + command + "\"");
  if (positional.size() > 1) return Usage("status takes no arguments");

  absl::StatusOr<optimus::v1::StatusResponse> status =
      optimus::FetchStatus(coordinator, absl::Milliseconds(timeout_ms));
  if (!status.ok()) {
    std::cerr << "optimusctl: " << status.status().message() << "\n";
    return 1;
  }
  std::cout << (json ? optimus::RenderStatusJson(*status) : optimus::RenderStatusTable(*status));
  std::cout.flush();
  return std::cout ? 0 : 1;
}
