#include "cli/commands.h"

#include <cstdint>
#include <exception>
#include <memory>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/command_util.h"
#include "cli/status.h"
#include "common/coordinator_channels.h"
#include "common/wire.h"

namespace optimus {
namespace {

constexpr char kRootFooter[] =
    "Global flags go before or after the command. Every read command takes\n"
    "-o table|json|yaml (--json: -o json).\n"
    "\n"
    "Exit codes:\n"
    "  0  the command did what it was asked\n"
    "  1  it failed (coordinator unreachable, job or shard not found, refused)\n"
    "  2  usage error (unknown command or flag, missing or bad value)\n"
    "\n"
    "Environment:\n"
    "  OPTIMUS_COORDINATOR         HOST:PORT (or several, comma-separated: a leader\n"
    "                              and its standbys) when --coordinator is not given\n"
    "  OPTIMUS_TLS_DIR             the folder when --tls_dir is not given\n"
    "  OPTIMUS_INSECURE_PLAINTEXT  1: plain-text gRPC (local clusters only)\n"
    "  OPTIMUS_JOB_TOKEN           job create: the token the new job takes\n"
    "\n"
    "Run `optimusctl COMMAND --help` for a command's flags.";

constexpr char kCommandFooter[] =
    "Global flags (see optimusctl --help): --coordinator HOST:PORT[,HOST:PORT...],\n"
    "--timeout_ms N, --tls_dir DIR, --insecure_plaintext.\n"
    "Exit codes: 0 done, 1 failed, 2 usage error.";

// The command the parse got furthest into (the root if none).
CLI::App* Deepest(CLI::App* app) {
  for (;;) {
    std::vector<CLI::App*> subs = app->get_subcommands();
    if (subs.empty()) return app;
    app = subs.front();
  }
}

// "optimusctl job delete".
std::string PathOf(const CLI::App* app) {
  std::vector<std::string> names;
  for (const CLI::App* a = app; a != nullptr; a = a->get_parent()) {
    names.insert(names.begin(), a->get_name());
  }
  return absl::StrJoin(names, " ");
}

bool IsGroup(const CLI::App* app) {
  return !app->get_subcommands([](const CLI::App*) { return true; }).empty();
}

// The message for a usage error: what was not understood, named, where the
// parse left words over; CLI11's own message otherwise.
std::string UsageMessage(CLI::App* root, const CLI::ParseError& e) {
  CLI::App* deepest = Deepest(root);
  const std::string path = PathOf(deepest);
  // Words no command took, wherever the parse left them.
  std::vector<std::string> extras;
  for (CLI::App* a = root;; a = a->get_subcommands().front()) {
    for (const std::string& x : a->remaining()) extras.push_back(x);
    if (a == deepest) break;
  }
  std::vector<std::string> parts;
  bool named_command = false;
  for (const std::string& x : extras) {
    if (absl::StartsWith(x, "-") && x.size() > 1) {
      parts.push_back(absl::StrCat("unknown flag ", x, " for `", path, "`"));
    } else if (IsGroup(deepest) && !named_command) {
      named_command = true;
      parts.push_back(deepest == root
                          ? absl::StrCat("unknown command \"", x, "\"")
                          : absl::StrCat("unknown ", deepest->get_name(), " command \"", x, "\""));
    } else if (!IsGroup(deepest)) {
      parts.push_back(absl::StrCat("unexpected argument \"", x, "\" for `", path, "`"));
    }
  }
  if (!parts.empty()) return absl::StrJoin(parts, "; ");
  if (IsGroup(deepest) && dynamic_cast<const CLI::RequiredError*>(&e) != nullptr &&
      absl::StrContains(e.what(), "subcommand")) {
    return deepest == root ? "no command given" : absl::StrCat("`", path, "` needs a command");
  }
  return absl::StrCat(path, ": ", e.what());
}

void SetFooters(CLI::App* app) {
  for (CLI::App* sub : app->get_subcommands([](const CLI::App*) { return true; })) {
    sub->footer(kCommandFooter);
    SetFooters(sub);
  }
}

}  // namespace

void AddOutputFlags(CLI::App* cmd, OutputFormat* format) {
  CLI::Option* o =
      cmd->add_option_function<std::string>(
             "-o,--output",
             [format](const std::string& name) { *format = *ParseOutputFormat(name); },
             "output format: table (default), json or yaml")
          ->type_name("FORMAT")
          ->check(CLI::Validator(
              [](std::string& name) -> std::string {
                absl::StatusOr<OutputFormat> f = ParseOutputFormat(name);
                return f.ok() ? std::string() : std::string(f.status().message());
              },
              "table|json|yaml", "output format"));
  cmd->add_flag_callback("--json", [format] { *format = OutputFormat::kJson; },
                         "the same as -o json")
      ->excludes(o);
}

void PrintResult(OutputFormat format, const std::function<Json()>& doc,
                 const std::function<std::string()>& table) {
  std::cout << (format == OutputFormat::kTable ? table() : RenderDocument(doc(), format));
  std::cout.flush();
}

int Fail(const absl::Status& s) {
  std::cout.flush();
  std::cerr << "optimusctl: " << s.message() << "\n";
  return 1;
}

void OnRun(CLI::App* cmd, int* exit_code, std::function<int()> action) {
  cmd->callback([exit_code, action = std::move(action)] { *exit_code = action(); });
}

void OnStatusRun(CLI::App* cmd, int* exit_code, const GlobalFlags* g,
                 std::function<int(const v1::StatusResponse&)> show) {
  OnStatusRun(cmd, exit_code, g, std::make_shared<const StatusQuery>(), std::move(show));
}

void OnStatusRun(CLI::App* cmd, int* exit_code, const GlobalFlags* g,
                 std::shared_ptr<const StatusQuery> query,
                 std::function<int(const v1::StatusResponse&)> show) {
  OnRun(cmd, exit_code, [g, query = std::move(query), show = std::move(show)]() -> int {
    if (!UseCoordinator(*g).ok()) return 2;
    absl::StatusOr<v1::StatusResponse> status = FetchStatus(g->coordinator, g->timeout(), *query);
    if (!status.ok()) return Fail(status.status());
    return show(*status);
  });
}

void AddPageSizeFlag(CLI::App* cmd, StatusQuery* query) {
  cmd->add_option("--page_size", query->page_size,
                  "shards per Status call (one message each); 0: all in one call")
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
}

absl::Status UseCoordinator(const GlobalFlags& globals) {
  SetCliConnectWait(globals.timeout());
  absl::Status s = SetCliTls(globals.tls);
  if (!s.ok()) {
    // LoadTls names the program itself.
    std::cerr << (absl::StartsWith(s.message(), "optimusctl") ? "" : "optimusctl: ")
              << s.message() << "\n";
  }
  return s;
}

CLI::Validator PositiveWhole(const std::string& what) {
  return CLI::Validator(
      [what](std::string& value) -> std::string {
        uint64_t n = 0;
        if (absl::SimpleAtoi(value, &n) && n > 0) return "";
        return absl::StrCat("\"", value, "\" is not ", what, " (a positive whole number)");
      },
      "", "positive whole number");
}

CLI::Validator CoordinatorAddresses() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        absl::StatusOr<std::vector<std::string>> list = ParseCoordinatorAddresses(value);
        return list.ok() ? std::string() : std::string(list.status().message());
      },
      "", "coordinator addresses");
}

CLI::Validator NonEmpty(const std::string& what) {
  return CLI::Validator(
      [what](std::string& value) -> std::string {
        return value.empty() ? absl::StrCat("needs ", what) : std::string();
      },
      "", "non-empty");
}

void ConfigureRoot(CLI::App* root, GlobalFlags* g) {
  auto formatter = std::make_shared<CLI::Formatter>();
  formatter->label("Usage", "usage");
  formatter->label("SUBCOMMAND", "COMMAND");
  formatter->label("SUBCOMMANDS", "COMMANDS");
  formatter->label("Subcommands", "Commands");
  formatter->column_width(34);
  root->formatter(formatter);
  root->group("Commands");  // Inherited by the commands: their heading in help.
  root->fallthrough(true);
  root->require_subcommand(1);
  root->footer(kRootFooter);
  root->set_version_flag("--version", absl::StrCat("optimusctl ", kOptimusctlVersion));
  root->add_option("--coordinator", g->coordinator,
                   "the coordinator's gRPC address; several (a leader and its standbys, "
                   "comma-separated): whichever leads")
      ->type_name("HOST:PORT[,HOST:PORT...]")
      ->envname("OPTIMUS_COORDINATOR")
      ->capture_default_str()
      ->check(CoordinatorAddresses());
  root->add_option("--timeout_ms", g->timeout_ms,
                   "give up on the coordinator after this many milliseconds")
      ->type_name("N")
      ->capture_default_str()
      ->check(PositiveWhole("a number of milliseconds"));
  CLI::Option* tls =
      root->add_option("--tls_dir", g->tls.dir,
                       "ca.crt, tls.crt, tls.key: TLS with this client certificate "
                       "(admin:<who> for most commands); default $OPTIMUS_TLS_DIR")
          ->type_name("DIR")
          ->check(NonEmpty("a folder"));
  root->add_flag("--insecure_plaintext", g->tls.plaintext,
                 "plain-text gRPC (a coordinator started with it; local only)")
      ->excludes(tls);
}

void AddStatusCommand(CLI::App* root, GlobalFlags* g, int* exit_code) {
  CLI::App* cmd = root->add_subcommand(
      "status", "shards (state, memory, chunks, backups) and jobs (step, replicas, last "
                "checkpoint, optimizer)");
  // The callbacks own the command's settings; its options write them.
  auto format = std::make_shared<OutputFormat>(OutputFormat::kTable);
  AddOutputFlags(cmd, format.get());
  auto query = std::make_shared<StatusQuery>();
  AddPageSizeFlag(cmd, query.get());
  OnStatusRun(cmd, exit_code, g, query, [format](const v1::StatusResponse& status) -> int {
    PrintResult(
        *format, [&] { return StatusToJson(status); },
        [&] { return RenderStatusTable(status); });
    return std::cout ? 0 : 1;
  });
}

void AddVersionCommand(CLI::App* root, int* exit_code) {
  CLI::App* cmd = root->add_subcommand("version", "optimusctl's version");
  auto format = std::make_shared<OutputFormat>(OutputFormat::kTable);
  AddOutputFlags(cmd, format.get());
  OnRun(cmd, exit_code, [format]() -> int {
    PrintResult(
        *format,
        [] {
          return Json{{"version", kOptimusctlVersion},
                      {"wire_protocol", wire::kVersion},
                      {"api", "optimus.v1"}};
        },
        [] {
          return absl::StrCat("optimusctl ", kOptimusctlVersion, " (coordinator API optimus.v1, "
                              "data-plane wire protocol ", wire::kVersion, ")\n");
        });
    return 0;
  });
}

int RunCommandLine(CLI::App* root, int argc, char** argv, const int* exit_code) {
  SetFooters(root);
  try {
    root->parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << root->help();
    return 0;
  } catch (const CLI::CallForAllHelp&) {
    std::cout << root->help("", CLI::AppFormatMode::All);
    return 0;
  } catch (const CLI::CallForVersion& e) {
    std::cout << e.what() << "\n";
    return 0;
  } catch (const CLI::ParseError& e) {
    std::cout.flush();
    std::cerr << "optimusctl: " << UsageMessage(root, e) << "\n\n" << root->help();
    return 2;
  } catch (const std::exception& e) {
    std::cout.flush();
    std::cerr << "optimusctl: " << e.what() << "\n";
    return 1;
  }
  return *exit_code;
}

}  // namespace optimus
