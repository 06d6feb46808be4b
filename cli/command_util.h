// What optimusctl's command files share: the -o/--json flags and printing a
// result in the chosen format, the failure path (exit 1), and the TLS
// set-up before the first RPC. Internal to //cli:commands; not thread-safe
// (one command line per process).
#ifndef OPTIMUS_CLI_COMMAND_UTIL_H_
#define OPTIMUS_CLI_COMMAND_UTIL_H_

#include <functional>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "cli/commands.h"
#include "cli/output.h"
#include "cli/status.h"

namespace optimus {

// Adds `-o,--output table|json|yaml` (default table) and `--json` (the same
// as -o json) to `cmd`; the choice lands in *format.
void AddOutputFlags(CLI::App* cmd, OutputFormat* format);

// Prints `table()` or `doc()` in `format` to stdout.
void PrintResult(OutputFormat format, const std::function<Json()>& doc,
                 const std::function<std::string()>& table);

// "optimusctl: MESSAGE" on stderr; returns 1.
int Fail(const absl::Status& s);

// Runs `action` when `cmd` was given, once the whole command line parsed;
// its result goes to *exit_code.
void OnRun(CLI::App* cmd, int* exit_code, std::function<int()> action);

// Like OnRun for a command that shows part of the coordinator's status:
// the TLS set-up (a usage error: 2), one Status call (its failure: 1), then
// `show` with the answer, whose result is the exit code.
void OnStatusRun(CLI::App* cmd, int* exit_code, const GlobalFlags* g,
                 std::function<int(const v1::StatusResponse&)> show);
// The same, fetching what *query says (its flags may fill it: it is read
// when the command runs).
void OnStatusRun(CLI::App* cmd, int* exit_code, const GlobalFlags* g,
                 std::shared_ptr<const StatusQuery> query,
                 std::function<int(const v1::StatusResponse&)> show);

// Adds `--page_size N` (shards per Status call, default
// kDefaultStatusPageSize; 0: all in one) to `cmd`, into query->page_size.
void AddPageSizeFlag(CLI::App* cmd, StatusQuery* query);

// Loads the TLS settings (SetCliTls) before a command's first RPC. Its
// error, printed, is a usage error: the caller returns 2.
absl::Status UseCoordinator(const GlobalFlags& globals);

// A validator for positive whole numbers (ids, seconds), naming `what`.
CLI::Validator PositiveWhole(const std::string& what);
// A validator for --coordinator: one HOST:PORT or several, comma-separated
// (common/coordinator_channels.h says what is accepted).
CLI::Validator CoordinatorAddresses();
// A validator for a non-empty value, naming what it should be.
CLI::Validator NonEmpty(const std::string& what);

}  // namespace optimus

#endif  // OPTIMUS_CLI_COMMAND_UTIL_H_
