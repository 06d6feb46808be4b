// `optimusctl checkpoint create|list|restore|export`.
#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/checkpoint.h"
#include "cli/command_util.h"
#include "cli/commands.h"
#include "cli/export.h"
#include "cli/status.h"

namespace optimus {
namespace {

std::string CheckpointLine(const v1::CheckpointInfo& c, const std::string& job) {
  return absl::StrCat("checkpoint ", c.checkpoint_id(), " of job ", job, " at step ", c.step(),
                      ": ", CheckpointStateName(c.state()),
                      c.error().empty() ? "" : absl::StrCat(" (", c.error(), ")"));
}

struct CreateFlags {
  std::string job;
  bool wait = false;
  OutputFormat format = OutputFormat::kTable;
};

int Create(const GlobalFlags& g, const CreateFlags& f) {
  if (!UseCoordinator(g).ok()) return 2;
  absl::StatusOr<v1::CheckpointInfo> info = CreateCheckpointRpc(g.coordinator, g.timeout(), f.job);
  if (!info.ok()) return Fail(info.status());
  v1::CheckpointInfo last = *info;
  std::string last_line;
  // A retry (a shard had passed the chosen step) gets a larger id.
  while (f.wait && last.state() == v1::CHECKPOINT_STATE_IN_PROGRESS) {
    const std::string line = CheckpointLine(last, f.job);
    if (line != last_line) {
      std::cerr << line << "\n";
      last_line = line;
    }
    absl::SleepFor(absl::Milliseconds(200));
    auto list = ListCheckpointsRpc(g.coordinator, g.timeout(), f.job);
    if (!list.ok()) return Fail(list.status());
    for (const auto& c : *list) {
      if (c.checkpoint_id() >= info->checkpoint_id()) last = c;
    }
  }
  PrintResult(
      f.format, [&] { return CheckpointToJson(last); },
      [&] { return CheckpointLine(last, f.job) + "\n"; });
  return last.state() == v1::CHECKPOINT_STATE_FAILED ? 1 : 0;
}

struct RestoreFlags {
  std::string job;
  uint64_t checkpoint_id = 0;
  std::string as_name;
  uint64_t max_chunk_bytes = 0;
  OutputFormat format = OutputFormat::kTable;
};

int Restore(const GlobalFlags& g, const RestoreFlags& f) {
  if (!UseCoordinator(g).ok()) return 2;
  v1::RestoreCheckpointRequest req;
  req.set_job_name(f.job);
  req.set_checkpoint_id(f.checkpoint_id);
  req.set_new_job_name(f.as_name);
  req.set_max_chunk_bytes(f.max_chunk_bytes);
  std::cerr << "verifying "
            << (f.checkpoint_id == 0 ? std::string("the newest complete checkpoint")
                                     : absl::StrCat("checkpoint ", f.checkpoint_id))
            << " of job " << f.job << " (every file's checksum) and restoring it...\n";
  // Verifying every checksum reads the whole checkpoint: allow for it.
  auto resp = RestoreCheckpointRpc(g.coordinator, std::max(g.timeout(), absl::Minutes(10)), req);
  if (!resp.ok()) return Fail(resp.status());
  const std::string name = f.as_name.empty() ? f.job : f.as_name;
  PrintResult(
      f.format,
      [&] {
        return Json{{"job_name", name},
                    {"job_id", resp->job_id()},
                    {"resume_step", resp->resume_step()},
                    {"checkpoint", CheckpointToJson(resp->checkpoint())}};
      },
      [&] {
        return absl::StrCat("restored checkpoint ", resp->checkpoint().checkpoint_id(),
                            " of job ", f.job, " as job ", name, " (id ", resp->job_id(),
                            "); workers join ", name, " and resume at step ",
                            resp->resume_step(), "\n");
      });
  return 0;
}

struct ExportFlags {
  std::string job;
  uint64_t checkpoint_id = 0;
  std::string out;
  std::string path;
  ExportFormat format = ExportFormat::kOptimus;
};

int Export(const GlobalFlags& g, const ExportFlags& f) {
  if (f.job.empty() == f.path.empty()) {
    throw CLI::ValidationError("needs a JOB (with the coordinator) or --path=DIR (without)");
  }
  std::string dir = f.path;
  if (dir.empty()) {
    if (!UseCoordinator(g).ok()) return 2;
    auto list = ListCheckpointsRpc(g.coordinator, g.timeout(), f.job);
    if (!list.ok()) return Fail(list.status());
    for (const auto& c : *list) {
      if (f.checkpoint_id == 0 ? c.state() == v1::CHECKPOINT_STATE_COMPLETE
                               : c.checkpoint_id() == f.checkpoint_id) {
        dir = c.path();
      }
    }
    if (dir.empty()) {
      return Fail(absl::NotFoundError(
          f.checkpoint_id == 0
              ? absl::StrCat("job ", f.job, " has no complete checkpoint")
              : absl::StrCat("job ", f.job, " has no checkpoint ", f.checkpoint_id)));
    }
  }
  std::cerr << "reading and verifying " << dir << ", writing " << f.out << "...\n";
  if (absl::Status s = ExportCheckpointToTorch(dir, f.out, f.format); !s.ok()) return Fail(s);
  std::cout << "exported " << dir << " to " << f.out << "\n";
  return 0;
}

}  // namespace

void AddCheckpointCommands(CLI::App* root, GlobalFlags* g, int* exit_code) {
  CLI::App* ckpt = root->add_subcommand(
      "checkpoint", "create, list, restore and export a job's checkpoints");
  ckpt->require_subcommand(1);

  {
    CLI::App* cmd = ckpt->add_subcommand(
        "create", "checkpoint JOB now (with --wait: until complete or failed; exit 1 if it "
                  "failed)");
    auto f = std::make_shared<CreateFlags>();
    cmd->add_option("JOB", f->job, "the job's name")->required();
    cmd->add_flag("--wait", f->wait, "until the checkpoint completes or fails; progress on stderr");
    AddOutputFlags(cmd, &f->format);
    OnRun(cmd, exit_code, [g, f]() -> int { return Create(*g, *f); });
  }

  {
    CLI::App* cmd = ckpt->add_subcommand(
        "list", "JOB's checkpoints: complete, in progress, failed (with why)");
    struct Flags {
      std::string job;
      OutputFormat format = OutputFormat::kTable;
    };
    auto f = std::make_shared<Flags>();
    cmd->add_option("JOB", f->job, "the job's name")->required();
    AddOutputFlags(cmd, &f->format);
    OnRun(cmd, exit_code, [g, f]() -> int {
      if (!UseCoordinator(*g).ok()) return 2;
      auto list = ListCheckpointsRpc(g->coordinator, g->timeout(), f->job);
      if (!list.ok()) return Fail(list.status());
      PrintResult(
          f->format, [&] { return CheckpointsToJson(*list); },
          [&] { return RenderCheckpointsTable(*list); });
      return 0;
    });
  }

  {
    CLI::App* cmd = ckpt->add_subcommand(
        "restore",
        "verify a checkpoint of JOB and create job --as (default JOB) from it on the live "
        "shards; workers join it and resume at the checkpoint's step");
    auto f = std::make_shared<RestoreFlags>();
    cmd->add_option("JOB", f->job, "the job's name")->required();
    cmd->add_option("--checkpoint", f->checkpoint_id,
                    "the checkpoint's id (default: the newest complete one)")
        ->type_name("ID")
        ->check(PositiveWhole("a checkpoint id"));
    cmd->add_option("--as", f->as_name, "the restored job's name (default JOB)")
        ->type_name("NAME")
        ->check(NonEmpty("a job name"));
    cmd->add_option("--max_chunk_bytes", f->max_chunk_bytes,
                    "re-chunk the restored job (default: as checkpointed)")
        ->type_name("N")
        ->check(CLI::Range(uint64_t{4}, ~uint64_t{0}));
    AddOutputFlags(cmd, &f->format);
    OnRun(cmd, exit_code, [g, f]() -> int { return Restore(*g, *f); });
  }

  {
    CLI::App* cmd = ckpt->add_subcommand(
        "export",
        "write a checkpoint as a file torch.load reads: JOB's (asks the coordinator where it "
        "is) or the folder --path (works without a coordinator); progress on stderr");
    auto f = std::make_shared<ExportFlags>();
    CLI::Option* job = cmd->add_option("JOB", f->job, "the job's name");
    cmd->add_option("--checkpoint", f->checkpoint_id,
                    "the checkpoint's id (default: the newest complete one)")
        ->type_name("ID")
        ->check(PositiveWhole("a checkpoint id"))
        ->needs(job);
    cmd->add_option("--path", f->path, "a checkpoint folder (DIR/JOB/ckpt-NNNNNN)")
        ->type_name("DIR")
        ->check(NonEmpty("a checkpoint folder"))
        ->excludes(job);
    cmd->add_option("--out", f->out, "the file to write")
        ->type_name("FILE")
        ->required()
        ->check(NonEmpty("a file name"));
    cmd->add_option_function<std::string>(
           "--format",
           [f](const std::string& name) { f->format = *ParseExportFormat(name); },
           "optimus (default: fp32 params and optimizer state by tensor name, groups, "
           "settings) or torch-optim ({\"model\": state_dict, \"optimizer\": what "
           "torch.optim's load_state_dict takes})")
        ->type_name("F")
        ->check(CLI::Validator(
            [](std::string& name) -> std::string {
              absl::StatusOr<ExportFormat> parsed = ParseExportFormat(name);
              return parsed.ok() ? std::string() : std::string(parsed.status().message());
            },
            "optimus|torch-optim", "export format"));
    OnRun(cmd, exit_code, [g, f]() -> int { return Export(*g, *f); });
  }
}

}  // namespace optimus
