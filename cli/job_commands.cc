// `optimusctl job list|describe|create|delete`.
#include <cstdlib>
#include <iostream>
#include <memory>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "cli/command_util.h"
#include "cli/commands.h"
#include "cli/lifecycle.h"
#include "cli/status.h"
#include "client/job_config.h"
#include "client/job_spec.h"
#include "common/security.h"

namespace optimus {
namespace {

struct CreateFlags {
  std::string file;
  std::string name;         // Overrides the file's name when set.
  uint32_t world_size = 0;  // Overrides the file's world_size when > 0.
  OutputFormat format = OutputFormat::kTable;
};

// The job the file describes, with the flags' overrides; INVALID_ARGUMENT
// (naming the file) when it cannot make a job on its own.
absl::StatusOr<client::JobDef> JobFromFile(const CreateFlags& f) {
  absl::StatusOr<client::JobConfig> config = client::LoadJobConfig(f.file);
  if (!config.ok()) return config.status();
  if (!config->has_tensors) {
    return absl::InvalidArgumentError(absl::StrCat(
        f.file, ": no `tensors:` list; `optimusctl job create -f` needs the job's tensors "
                "(a trainer creates a job from its model instead: docs/job-spec.md)"));
  }
  client::JobDef def = config->def;
  if (absl::Status s = client::AssignGroups(*config, &def); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(f.file, ": ", s.message()));
  }
  if (!f.name.empty()) def.name = f.name;
  if (f.world_size > 0) def.world_size = f.world_size;
  if (def.name.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.file, ": the job has no name (set `name:` or --name)"));
  }
  if (!config->has_world_size && f.world_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        f.file, ": the job has no world size (set `world_size:` or --world_size)"));
  }
  return def;
}

int Create(const GlobalFlags& g, const CreateFlags& f) {
  absl::StatusOr<client::JobDef> def = JobFromFile(f);
  if (!def.ok()) return Fail(def.status());
  if (!UseCoordinator(g).ok()) return 2;
  // A launcher that chose the token its workers share passes it here.
  const char* env_token = std::getenv(security::kJobTokenEnv);
  const std::string token = env_token != nullptr ? env_token : "";
  absl::StatusOr<v1::CreateJobResponse> resp =
      CreateJobRpc(g.coordinator, g.timeout(), client::ToJobSpec(*def), token);
  if (!resp.ok()) return Fail(resp.status());
  std::set<uint64_t> shards;
  for (const v1::ChunkPlacement& c : resp->map().chunks()) {
    shards.insert(c.shard_id());
    if (c.backup_shard_id() != 0) shards.insert(c.backup_shard_id());
  }
  PrintResult(
      f.format,
      [&] {
        return Json{{"name", def->name},
                    {"job_id", resp->job_id()},
                    {"world_size", def->world_size},
                    {"num_tensors", def->tensors.size()},
                    {"num_chunks", resp->map().chunks_size()},
                    {"shards", shards},
                    {"job_token", resp->job_token()}};
      },
      [&] {
        return absl::StrCat(
            "job ", def->name, " created (id ", resp->job_id(), "): ", def->tensors.size(),
            " tensors in ", resp->map().chunks_size(), " chunks on ", shards.size(),
            " shards; workers join it as ranks 0..", def->world_size - 1, "\n",
            "worker token (a secret: give it only to the job's workers, as ",
            security::kJobTokenEnv, "): ", resp->job_token(), "\n");
      });
  return 0;
}

}  // namespace

void AddJobCommands(CLI::App* root, GlobalFlags* g, int* exit_code) {
  CLI::App* job = root->add_subcommand("job", "list, describe, create and delete jobs");
  job->require_subcommand(1);

  {
    CLI::App* cmd = job->add_subcommand(
        "list", "every job: state, workers, step, tensors, bytes, chunks, replicas, last "
                "checkpoint");
    auto format = std::make_shared<OutputFormat>(OutputFormat::kTable);
    AddOutputFlags(cmd, format.get());
    OnStatusRun(cmd, exit_code, g, [format](const v1::StatusResponse& st) -> int {
      PrintResult(
          *format,
          [&] {
            Json jobs = Json::array();
            for (const v1::JobStatus& j : st.jobs()) jobs.push_back(JobToJson(j));
            return Json{{"jobs", std::move(jobs)}};
          },
          [&] { return RenderJobsTable(st); });
      return 0;
    });
  }

  {
    CLI::App* cmd = job->add_subcommand(
        "describe", "one job: what status shows of it, and its optimizer and parameter groups");
    struct Flags {
      std::string name;
      OutputFormat format = OutputFormat::kTable;
    };
    auto f = std::make_shared<Flags>();
    cmd->add_option("NAME", f->name, "the job's name")->required();
    AddOutputFlags(cmd, &f->format);
    OnStatusRun(cmd, exit_code, g, [f](const v1::StatusResponse& st) -> int {
      const v1::JobStatus* j = FindJob(st, f->name);
      if (j == nullptr) {
        return Fail(absl::NotFoundError(absl::StrCat("no job named \"", f->name, "\"")));
      }
      PrintResult(
          f->format, [&] { return JobToJson(*j); }, [&] { return RenderJobDetail(*j); });
      return 0;
    });
  }

  {
    CLI::App* cmd = job->add_subcommand(
        "create",
        "create a job from a job spec file (YAML or JSON, docs/job-spec.md, with its "
        "tensors); prints its id and its worker token, a secret its workers need to join "
        "(OPTIMUS_JOB_TOKEN set: the job takes that token)");
    auto f = std::make_shared<CreateFlags>();
    cmd->add_option("-f,--file", f->file, "the job spec file")
        ->type_name("FILE")
        ->required()
        ->check(CLI::ExistingFile);
    cmd->add_option("--name", f->name, "the job's name (default: the file's `name:`)")
        ->check(NonEmpty("a job name"));
    cmd->add_option("--world_size", f->world_size,
                    "workers (default: the file's `world_size:`)")
        ->type_name("N")
        ->check(PositiveWhole("a number of workers"));
    AddOutputFlags(cmd, &f->format);
    OnRun(cmd, exit_code, [g, f]() -> int { return Create(*g, *f); });
  }

  {
    CLI::App* cmd = job->add_subcommand(
        "delete",
        "end a job: it leaves the coordinator's tables and status at once and its shards "
        "free its memory (its checkpoints stay on disk); refused while workers are joined "
        "unless --force (a FAILED job, or one whose workers all left, needs none)");
    struct Flags {
      std::string name;
      bool force = false;
    };
    auto f = std::make_shared<Flags>();
    cmd->add_option("NAME", f->name, "the job's name")->required()->check(NonEmpty("a job name"));
    cmd->add_flag("--force", f->force, "also while workers are joined (their requests fail)");
    OnRun(cmd, exit_code, [g, f]() -> int {
      if (!UseCoordinator(*g).ok()) return 2;
      absl::StatusOr<v1::DeleteJobResponse> resp =
          DeleteJobRpc(g->coordinator, g->timeout(), f->name, f->force);
      if (!resp.ok()) return Fail(resp.status());
      std::cout << RenderJobDeleted(f->name, *resp);
      return 0;
    });
  }
}

}  // namespace optimus
