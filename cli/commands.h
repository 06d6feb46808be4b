// optimusctl's commands on CLI11. Each Add* call registers one command group
// on the root app (`optimusctl`), each command with its own flags and
// --help. A command runs from its CLI11 callback, after the whole command
// line parsed cleanly, and leaves its exit code in *exit_code (0 done, 1
// failed); every usage error is a CLI11 exception that RunCommandLine turns
// into exit code 2 with a message naming the flag and the command's usage.
// One command line per process: not thread-safe. The pointers given to the
// Add* calls must outlive RunCommandLine.
#ifndef OPTIMUS_CLI_COMMANDS_H_
#define OPTIMUS_CLI_COMMANDS_H_

#include <cstdint>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/time/time.h"
#include "common/security.h"
#include "common/version.h"

namespace optimus {

// Flags every command that talks to the coordinator takes, before or after
// the command's name.
struct GlobalFlags {
  // --coordinator HOST:PORT; default $OPTIMUS_COORDINATOR, else this.
  std::string coordinator = "127.0.0.1:7070";
  // --timeout_ms: how long one RPC may take.
  int64_t timeout_ms = 3000;
  // --tls_dir DIR / --insecure_plaintext (see common/security.h).
  security::TlsOptions tls;
  absl::Duration timeout() const { return absl::Milliseconds(timeout_ms); }
};

// The root's own flags (the globals above and --version), its help footer
// (exit codes, environment), "usage:" labels, at most one command, and that
// every command hands the flags it does not know to the root (so global
// flags go before or after the command; any other unknown flag is a usage
// error). Call it first.
void ConfigureRoot(CLI::App* root, GlobalFlags* globals);

// `status`.
void AddStatusCommand(CLI::App* root, GlobalFlags* globals, int* exit_code);
// `job list|describe|create|delete`.
void AddJobCommands(CLI::App* root, GlobalFlags* globals, int* exit_code);
// `shard list|describe|drain|forget`, and `drain` (the same as `shard
// drain`, which scripts use).
void AddShardCommands(CLI::App* root, GlobalFlags* globals, int* exit_code);
// `checkpoint create|list|restore|export`.
void AddCheckpointCommands(CLI::App* root, GlobalFlags* globals, int* exit_code);
// `version`.
void AddVersionCommand(CLI::App* root, int* exit_code);

// Parses argv, runs the command, and returns the process's exit code: the
// command's *exit_code, 0 after --help, 2 for a usage error.
int RunCommandLine(CLI::App* root, int argc, char** argv, const int* exit_code);

// optimusctl's version (the release's; the Helm chart's version).
inline constexpr const char* kOptimusctlVersion = kOptimusVersion;  // common/version.h

}  // namespace optimus

#endif  // OPTIMUS_CLI_COMMANDS_H_
