// `plan` on its own: the subcommand as optimusctl registers it
// (AddPlanCommand), on a root app of its own, so it can be run and tested
// before and apart from the rest of optimusctl.
//   bazel run //cli:plan_main -- plan --model=llama-70b --dp=2 --tp=2 --pp=4 --zero=3
#include <CLI/CLI.hpp>

#include "cli/plan_command.h"

int main(int argc, char** argv) {
  CLI::App app{"optimusctl plan, stand-alone"};
  app.require_subcommand(1);
  int exit_code = 0;
  optimus::plan::AddPlanCommand(&app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help is a ParseError with exit code 0; every other one is usage.
    return app.exit(e) == 0 ? 0 : 2;
  }
  return exit_code;
}
