// `optimusctl plan`: the subcommand's flags (a model preset, a job spec file
// or a parameter count; the parallelism layout; the optimizer and dtypes;
// the hardware; the kernel figures), and the report of cli/plan.h printed
// as a table, JSON or YAML. One call registers it on optimusctl's CLI11 app.
// Not thread-safe: CLI11 apps are parsed from one thread.
#ifndef OPTIMUS_CLI_PLAN_COMMAND_H_
#define OPTIMUS_CLI_PLAN_COMMAND_H_

#include <cstdint>
#include <ostream>
#include <string>

#include <CLI/CLI.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "cli/plan.h"

namespace optimus {
namespace plan {

// Adds the subcommand `plan` to `root`. When it runs, the report goes to
// stdout and *exit_code is set: 0 ok, 1 failure (an unreadable file), 2
// usage (a bad flag value or combination, named in the message on stderr).
// Flag parse errors (an unknown flag, a value out of a flag's range) are
// thrown by root->parse() as CLI::ParseError, as for every subcommand: the
// caller exits 2 with CLI11's message, which names the flag.
// `root` and `exit_code` must outlive the parse.
void AddPlanCommand(CLI::App* root, int* exit_code);

// As above, printing the report to *out and errors to *err (both must
// outlive the parse).
void AddPlanCommand(CLI::App* root, int* exit_code, std::ostream* out, std::ostream* err);

// "80GiB", "32 GB", "1.5TiB", "4MiB", "4194304": bytes. K/M/G/T alone are
// binary (as in job specs), KB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary.
// INVALID_ARGUMENT for anything else or a result over 2^62.
absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text);

// "70e9", "70B", "124M", "1.5T", "124439808": a parameter count (K = 1e3,
// M = 1e6, B or G = 1e9, T = 1e12). INVALID_ARGUMENT unless it is a whole
// number from 1 to 2^50.
absl::StatusOr<uint64_t> ParseParamCount(absl::string_view text);

// The report as optimusctl prints it: a table (each figure, then its
// accounting), JSON or YAML (the same tree: {"input": {...}, "<section>":
// {"<key>": {"label", "value", "unit", "text", "accounting"}}}).
std::string RenderTable(const PlanInput& in, const PlanReport& report);
std::string RenderJson(const PlanInput& in, const PlanReport& report);
std::string RenderYaml(const PlanInput& in, const PlanReport& report);

}  // namespace plan
}  // namespace optimus

#endif  // OPTIMUS_CLI_PLAN_COMMAND_H_
