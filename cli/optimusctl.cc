// optimusctl: the operator's command line for an optimus cluster, in
// kubectl's manner (CLI11: every command has its own flags and --help):
//   optimusctl [--coordinator=HOST:PORT[,HOST:PORT...]] [--timeout_ms=N]
//              [--tls_dir=DIR | --insecure_plaintext] COMMAND [flags]
//   status | version
//   job list | describe NAME | create -f FILE | delete NAME [--force]
//   shard list | describe ID | drain ID [--wait [--wait_s=N]] | forget ID
//   checkpoint create JOB [--wait] | list JOB | restore JOB [...] |
//              export [JOB | --path=DIR] --out=FILE [--format=F]
//   drain ID (the same as shard drain)
//   plan --model=M | --params=N [--dp --tp --pp --zero ...] (sizing)
// Read commands take -o table|json|yaml (--json: -o json). The coordinator
// defaults to $OPTIMUS_COORDINATOR, else 127.0.0.1:7070. Exit codes: 0
// success, 1 the command failed (e.g. coordinator unreachable), 2 usage
// error (any flag or argument not understood). See docs/operations.md.
#include "CLI/CLI.hpp"
#include "cli/commands.h"
#include "cli/plan_command.h"
#include "cli/status.h"

int main(int argc, char** argv) {
  CLI::App app("optimusctl: the operator's command line for an optimus cluster", "optimusctl");
  optimus::GlobalFlags globals;
  int exit_code = 0;
  optimus::ConfigureRoot(&app, &globals);
  // One call per command group.
  optimus::AddStatusCommand(&app, &globals, &exit_code);
  optimus::AddJobCommands(&app, &globals, &exit_code);
  optimus::AddShardCommands(&app, &globals, &exit_code);
  optimus::AddCheckpointCommands(&app, &globals, &exit_code);
  optimus::plan::AddPlanCommand(&app, &exit_code);
  optimus::AddVersionCommand(&app, &exit_code);
  const int code = optimus::RunCommandLine(&app, argc, argv, &exit_code);
  optimus::ReleaseCliChannels();
  return code;
}
