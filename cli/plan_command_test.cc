// `optimusctl plan` as a user runs it: the subcommand registered on a CLI11
// app the way optimusctl registers it, argv parsed, output read back.
#include "cli/plan_command.h"

#include <yaml-cpp/yaml.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace optimus {
namespace plan {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct Result {
  int code = -1;
  std::string out;
  std::string err;
};

// What optimusctl does with its argv: parse; a CLI11 parse error is a
// usage error (exit 2) with CLI11's message, --help exits 0.
Result RunCli(std::vector<std::string> args) {
  CLI::App app{"optimusctl"};
  app.require_subcommand(1);
  int rc = -1;
  std::ostringstream out, err;
  AddPlanCommand(&app, &rc, &out, &err);
  args.insert(args.begin(), "optimusctl");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  Result r;
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
    r.code = rc;
  } catch (const CLI::ParseError& e) {
    std::ostringstream help_out, help_err;
    r.code = app.exit(e, help_out, help_err) == 0 ? 0 : 2;
    out << help_out.str();
    err << help_err.str();
  }
  r.out = out.str();
  r.err = err.str();
  return r;
}

const std::vector<std::string> kPaper = {"plan", "--dp=2", "--tp=2", "--pp=4", "--zero=3"};

std::vector<std::string> With(std::vector<std::string> a, std::vector<std::string> more) {
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

// The table line that starts with `label` (after the indent).
std::string TableLine(const std::string& table, const std::string& label) {
  for (absl::string_view line : absl::StrSplit(table, '\n')) {
    if (absl::StartsWith(absl::StripLeadingAsciiWhitespace(line), label + " ")) {
      return std::string(line);
    }
  }
  ADD_FAILURE() << "no line '" << label << "' in:\n" << table;
  return "";
}

// The first number of the value column: "  parameters held   8.75 B params" -> 8.75.
double TableNumber(const std::string& line, const std::string& label) {
  std::string rest(absl::StripAsciiWhitespace(line));
  rest = std::string(absl::StripAsciiWhitespace(rest.substr(label.size())));
  double v = -1;
  EXPECT_TRUE(absl::SimpleAtod(rest.substr(0, rest.find(' ')), &v)) << line;
  return v;
}

TEST(PlanCommandTest, PaperExampleTablePrintsThePapersNumbersLabelled) {
  Result r = RunCli(With(kPaper, {"--params=70e9"}));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(TableLine(r.out, "parameters held"), HasSubstr("8.75 B params"));
  EXPECT_THAT(TableLine(r.out, "model states, no ZeRO"), HasSubstr("140.00 GB"));
  EXPECT_THAT(TableLine(r.out, "total without offload"), HasSubstr("70.00 GB"));
  EXPECT_THAT(TableLine(r.out, "offloaded: optimizer state (m, v)"), HasSubstr("35.00 GB"));
  EXPECT_THAT(TableLine(r.out, "offloaded: optimizer state + master"), HasSubstr("52.50 GB"));
  EXPECT_THAT(TableLine(r.out, "model states"), HasSubstr("1.12 TB"));
  // Each figure is followed by its accounting.
  EXPECT_THAT(r.out, HasSubstr("= 8.75 B params x 8 B (fp32 m, v) / 2 (ZeRO-3 over DP 2)"));
  EXPECT_THAT(r.out, HasSubstr("= 70,000,000,000 / (TP 2 x PP 4)"));
}

TEST(PlanCommandTest, PaperExampleJsonGivesTheSameNumbers) {
  Result r = RunCli(With(kPaper, {"--params", "70B", "-o", "json"}));
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  const nlohmann::json& g = j["per_gpu"];
  EXPECT_EQ(g["params"]["value"].get<double>(), 8.75e9);
  EXPECT_EQ(g["model_states_bytes"]["value"].get<double>(), 140e9);
  EXPECT_EQ(g["total_bytes"]["value"].get<double>(), 70e9);
  EXPECT_EQ(g["offload_optimizer_state_bytes"]["value"].get<double>(), 35e9);
  EXPECT_EQ(g["offload_with_master_bytes"]["value"].get<double>(), 52.5e9);
  EXPECT_EQ(g["offload_with_master_bytes"]["unit"], "bytes");
  EXPECT_THAT(g["offload_with_master_bytes"]["accounting"].get<std::string>(),
              HasSubstr("optimus moves the master off the GPU too"));
  EXPECT_EQ(j["input"]["dp"], 2);
  EXPECT_EQ(j["input"]["zero"], 3);
  EXPECT_EQ(j["model"]["params"]["value"].get<uint64_t>(), 70000000000u);
}

// The preset has 68.98 B parameters where the paper rounds to 70 B.
TEST(PlanCommandTest, PaperExampleWithThePresetIsWithinTwoPercentInTableAndJson) {
  Result table = RunCli(With(kPaper, {"--model=llama-70b"}));
  ASSERT_EQ(table.code, 0) << table.err;
  Result json = RunCli(With(kPaper, {"--model=llama-70b", "-o", "json"}));
  ASSERT_EQ(json.code, 0) << json.err;
  nlohmann::json j = nlohmann::json::parse(json.out);
  struct Want {
    const char* label;
    const char* key;
    double paper;  // In the table's unit (B params, GB).
  } wants[] = {
      {"parameters held", "params", 8.75},
      {"model states, no ZeRO", "model_states_bytes", 140},
      {"total without offload", "total_bytes", 70},
      {"offloaded: optimizer state (m, v)", "offload_optimizer_state_bytes", 35},
      {"offloaded: optimizer state + master", "offload_with_master_bytes", 52.5},
  };
  for (const Want& w : wants) {
    EXPECT_NEAR(TableNumber(TableLine(table.out, w.label), w.label), w.paper, 0.02 * w.paper)
        << w.label;
    EXPECT_NEAR(j["per_gpu"][w.key]["value"].get<double>(), w.paper * 1e9, 0.02 * w.paper * 1e9)
        << w.key;
  }
  EXPECT_EQ(j["model"]["params"]["value"].get<uint64_t>(), 68976648192u);
  EXPECT_EQ(j["per_gpu"]["params"]["value"].get<uint64_t>(), 68976648192u / 8);
  // The placement says 16 BlueField-3s are not enough for the optimizer
  // state of LLaMA-70B (the paper's point: host memory is needed).
  EXPECT_EQ(j["cluster"]["fits"]["value"], false);
  EXPECT_GT(j["cluster"]["host_memory_needed_bytes"]["value"].get<double>(), 0);
}

TEST(PlanCommandTest, YamlCarriesTheSameTree) {
  Result json = RunCli(With(kPaper, {"--params=70e9", "-o", "json"}));
  Result yaml = RunCli(With(kPaper, {"--params=70e9", "--output=yaml"}));
  ASSERT_EQ(json.code, 0) << json.err;
  ASSERT_EQ(yaml.code, 0) << yaml.err;
  nlohmann::json j = nlohmann::json::parse(json.out);
  YAML::Node y = YAML::Load(yaml.out);
  for (const char* key : {"params", "total_bytes", "offload_optimizer_state_bytes",
                          "offload_with_master_bytes", "with_optimus_bytes"}) {
    EXPECT_EQ(y["per_gpu"][key]["value"].as<double>(), j["per_gpu"][key]["value"].get<double>())
        << key;
    EXPECT_EQ(y["per_gpu"][key]["accounting"].as<std::string>(),
              j["per_gpu"][key]["accounting"].get<std::string>());
  }
  EXPECT_EQ(y["cluster"]["fits"]["value"].as<bool>(), j["cluster"]["fits"]["value"].get<bool>());
}

TEST(PlanCommandTest, UsageErrorsExitTwoNamingTheFlag) {
  struct Case {
    std::vector<std::string> args;
    const char* want;
  } cases[] = {
      {{"plan", "--model=llama-70b", "--dp=0"}, "--dp"},
      {{"plan", "--model=llama-70b", "--zero=4"}, "--zero"},
      {{"plan", "--model=llama-8b"}, "--model"},
      {{"plan", "--model=llama-7b", "--params=7e9"}, "--params"},
      {{"plan", "--dp=2"}, "--model NAME, --model_file FILE or --params N"},
      {{"plan", "--params=70e9", "--gpu_memory=lots"}, "--gpu_memory"},
      {{"plan", "--params=1.5"}, "--params"},
      {{"plan", "--params=70e9", "--replication=2"}, "--replication"},
      {{"plan", "--params=70e9", "-o", "xml"}, "--output"},
      {{"plan", "--params=70e9", "--as=x"}, "--as"},
      {{"plan", "--model_file=/nonexistent/job.yaml"}, "--model_file"},
  };
  for (const Case& c : cases) {
    Result r = RunCli(c.args);
    EXPECT_EQ(r.code, 2) << c.args.back() << "\n" << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.want)) << c.args.back();
    EXPECT_EQ(r.out.find("Per GPU"), std::string::npos) << "no report on a usage error";
  }
}

TEST(PlanCommandTest, HelpListsTheFlags) {
  Result r = RunCli({"plan", "--help"});
  EXPECT_EQ(r.code, 0);
  for (const char* flag : {"--model", "--model_file", "--params", "--dp", "--tp", "--pp", "--zero",
                           "--optimizer", "--param_dtype", "--grad_dtype", "--master_dtype",
                           "--gpus_per_node", "--gpu_memory", "--dpu_memory", "--dpu_cores",
                           "--host_memory", "--replication", "--kernel_bench", "--output",
                           "llama-70b"}) {
    EXPECT_THAT(r.out, HasSubstr(flag));
  }
}

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = std::string(std::getenv("TEST_TMPDIR")) + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(PlanCommandTest, AJobSpecFileGivesTheModelAndItsSettings) {
  const std::string spec = WriteFile(
      "job.yaml",
      "name: g\nworld_size: 4\nmodel: gpt2-124m\noptimizer: {type: sgd}\nreplication: 1\n");
  Result r = RunCli({"plan", "--model_file", spec, "-o", "json"});
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["model"]["params"]["value"].get<uint64_t>(), 124439808u);
  EXPECT_EQ(j["input"]["dp"], 4);  // world_size, as --dp was not given.
  EXPECT_EQ(j["input"]["optimizer"], "sgd");
  EXPECT_EQ(j["input"]["replication"], 1);
  // SGD keeps master + momentum (8 B), two bf16 copies (4), the sum
  // forwarded to the backup (4) and the gradients' fp32 sum (4).
  EXPECT_EQ(j["shards"]["bytes_per_elem"]["value"], 20);
  // A flag wins over the file.
  r = RunCli({"plan", "--model_file", spec, "--dp=2", "--optimizer=adamw", "-o", "json"});
  ASSERT_EQ(r.code, 0) << r.err;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["input"]["dp"], 2);
  EXPECT_EQ(j["input"]["optimizer"], "adamw");

  const std::string tensors = WriteFile(
      "tensors.json", "{\"tensors\": [{\"name\": \"w\", \"shape\": [1000, 1000]}, "
                      "{\"name\": \"b\", \"shape\": [1000]}]}");
  r = RunCli({"plan", "--model_file", tensors, "-o", "json"});
  ASSERT_EQ(r.code, 0) << r.err;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["model"]["params"]["value"].get<uint64_t>(), 1001000u);
  EXPECT_EQ(j["shards"]["chunks"]["value"], 2);

  const std::string none = WriteFile("none.yaml", "name: x\n");
  r = RunCli({"plan", "--model_file", none});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("lists no `tensors` and names no `model`"));
  const std::string bad = WriteFile("bad.yaml", "name: x\nmodel: gpt5\n");
  r = RunCli({"plan", "--model_file", bad});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("bad.yaml:2: model: unknown model preset 'gpt5'"));
}

TEST(PlanCommandTest, KernelBenchFileSetsTheStepTime) {
  const std::string bench = WriteFile(
      "kernels.jsonl",
      "{\"bench\": \"server_step\", \"sweep\": \"headline\", \"workers\": 2, \"threads\": 2, "
      "\"gparams_per_s\": 2.0}\n");
  Result r = RunCli({"plan", "--params=1e9", "--dp=2", "--dpu_cores=4", "--kernel_bench", bench,
                  "-o", "json"});
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["step_time"]["elems_per_s_per_core"]["value"].get<double>(), 1e9);
  EXPECT_THAT(j["step_time"]["kernel_bytes_per_s_per_core"]["accounting"].get<std::string>(),
              HasSubstr("kernels.jsonl, line 1"));
  EXPECT_THAT(j["input"]["kernel_bench"].get<std::string>(), HasSubstr("kernels.jsonl"));

  const std::string broken = WriteFile("broken.jsonl", "{\"bench\": \"server_step\"\n");
  r = RunCli({"plan", "--params=1e9", "--kernel_bench", broken});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("broken.jsonl:1: not a JSON object"));

  // Without the flag: the figures recorded in the repo, named.
  r = RunCli({"plan", "--params=1e9"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("bench/kernels of 2026-11-23"));
}

TEST(PlanCommandTest, SizesAndCountsParse) {
  EXPECT_EQ(*ParseByteSize("80GiB"), uint64_t{80} << 30);
  EXPECT_EQ(*ParseByteSize("32 GB"), 32000000000u);
  EXPECT_EQ(*ParseByteSize("4M"), uint64_t{4} << 20);
  EXPECT_EQ(*ParseByteSize("1.5TiB"), uint64_t{3} << 39);
  EXPECT_EQ(*ParseByteSize("4194304"), 4194304u);
  EXPECT_FALSE(ParseByteSize("lots").ok());
  EXPECT_FALSE(ParseByteSize("-1GB").ok());
  EXPECT_FALSE(ParseByteSize("3 parsecs").ok());
  EXPECT_EQ(*ParseParamCount("70e9"), 70000000000u);
  EXPECT_EQ(*ParseParamCount("70B"), 70000000000u);
  EXPECT_EQ(*ParseParamCount("8.75e9"), 8750000000u);
  EXPECT_EQ(*ParseParamCount("124M"), 124000000u);
  EXPECT_EQ(*ParseParamCount("124439808"), 124439808u);
  EXPECT_FALSE(ParseParamCount("0").ok());
  EXPECT_FALSE(ParseParamCount("1.5").ok());
  EXPECT_FALSE(ParseParamCount("70 GiB").ok());
  EXPECT_FALSE(ParseParamCount("1e300").ok());
}

}  // namespace
}  // namespace plan
}  // namespace optimus
