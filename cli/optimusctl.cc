// optimusctl: the operator's command line for an optimus cluster.
//   optimusctl [--coordinator=HOST:PORT] [--timeout_ms=N] status [--json]
//   optimusctl checkpoint create|list|restore|export JOB [options]
//     (export --format=optimus|torch-optim)
//   optimusctl drain SHARD_ID [--wait [--wait_s=N]]
//   optimusctl job delete NAME [--force]
//   optimusctl shard forget SHARD_ID
// Exit codes: 0 success, 1 the command failed (e.g. coordinator
// unreachable), 2 usage error. Flags are parsed by hand so that every usage
// error, including an unknown flag, exits 2 with the usage text.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/checkpoint.h"
#include "cli/drain.h"
#include "cli/export.h"
#include "cli/lifecycle.h"
#include "cli/status.h"

namespace {

constexpr char kUsage[] =
    "usage: optimusctl [--coordinator=HOST:PORT] [--timeout_ms=N]\n"
    "                  [--tls_dir=DIR | --insecure_plaintext] <command> [options]\n"
    "\n"
    "  --tls_dir DIR     ca.crt, tls.crt, tls.key: TLS with this client certificate\n"
    "                    (admin:<who> for most commands); default $OPTIMUS_TLS_DIR\n"
    "  --insecure_plaintext\n"
    "                    plain-text gRPC (a coordinator started with it; local only)\n"
    "\n"
    "commands:\n"
    "  status [--json]   shards (state, chunks, backups) and jobs (replicas in sync)\n"
    "  drain SHARD_ID [--wait] [--wait_s=N]\n"
    "                    move every chunk off the shard while training runs\n"
    "                    (promote its backups, seed new ones); with --wait: until it\n"
    "                    holds none (exit 0) or N seconds pass (default 300, exit 1);\n"
    "                    then stop the shard\n"
    "  job delete JOB [--force]\n"
    "                    end JOB: it leaves the coordinator's tables and status at once\n"
    "                    and its shards free its memory (its checkpoints stay on disk);\n"
    "                    refused while workers are joined unless --force (a FAILED job,\n"
    "                    or one whose workers all left, needs none)\n"
    "  shard forget SHARD_ID\n"
    "                    remove a DOWN shard from the tables now (DOWN shards also leave\n"
    "                    on their own after the coordinator's --down_shard_grace)\n"
    "  checkpoint create JOB [--wait]\n"
    "                    checkpoint JOB now (with --wait: until complete or failed)\n"
    "  checkpoint list JOB [--json]\n"
    "                    JOB's checkpoints: complete, in progress, failed (with why)\n"
    "  checkpoint restore JOB [--checkpoint=ID] [--as=NAME] [--max_chunk_bytes=N]\n"
    "                    verify checkpoint ID (default: the newest complete one) and\n"
    "                    create job NAME (default JOB) from it on the live shards;\n"
    "                    workers join NAME and resume at the checkpoint's step\n"
    "  checkpoint export JOB [--checkpoint=ID] --out=FILE [--format=F]\n"
    "  checkpoint export --path=CHECKPOINT_DIR --out=FILE [--format=F]\n"
    "                    write a file torch.load reads (--path works without a\n"
    "                    coordinator); F is optimus (default: fp32 params and\n"
    "                    optimizer state by tensor name, groups, settings) or\n"
    "                    torch-optim ({\"model\": state_dict, \"optimizer\": what\n"
    "                    torch.optim's load_state_dict takes})\n"
    "\n"
    "flags:\n"
    "  --coordinator=HOST:PORT  coordinator address (default 127.0.0.1:7070)\n"
    "  --timeout_ms=N           give up on the coordinator after N ms (default 3000)\n"
    "  --json                   print one JSON object instead of tables\n"
    "  --wait_s=N               drain --wait gives up after N seconds (default 300)\n"
    "  --force                  job delete: also while workers are joined\n"
    "  --format=F               checkpoint export: optimus (default) or torch-optim\n";

int Usage(const std::string& error) {
  if (!error.empty()) std::cerr << "optimusctl: " << error << "\n\n";
  std::cerr << kUsage;
  return 2;
}

int Fail(const absl::Status& s) {
  std::cerr << "optimusctl: " << s.message() << "\n";
  return 1;
}

int Checkpoint(const std::string& coordinator, absl::Duration timeout,
               const std::vector<std::string>& positional, bool json, bool wait,
               uint64_t checkpoint_id, const std::string& as_name, uint64_t max_chunk_bytes,
               const std::string& out_path, const std::string& ckpt_path,
               optimus::ExportFormat format) {
  if (positional.size() < 2) return Usage("checkpoint needs create, list, restore or export");
  const std::string& sub = positional[1];
  const bool export_by_path = sub == "export" && !ckpt_path.empty();
  if (export_by_path ? positional.size() != 2 : positional.size() != 3) {
    return Usage(export_by_path ? "checkpoint export --path=DIR takes no job name"
                                : absl::StrCat("checkpoint ", sub, " needs one job name"));
  }
  const std::string job = export_by_path ? "" : positional[2];
  if (sub == "create") {
    absl::StatusOr<optimus::v1::CheckpointInfo> info =
        optimus::CreateCheckpointRpc(coordinator, timeout, job);
    if (!info.ok()) return Fail(info.status());
    optimus::v1::CheckpointInfo last = *info;
    // A retry (a shard had passed the chosen step) gets a larger id.
    while (wait && last.state() == optimus::v1::CHECKPOINT_STATE_IN_PROGRESS) {
      absl::SleepFor(absl::Milliseconds(200));
      auto list = optimus::ListCheckpointsRpc(coordinator, timeout, job);
      if (!list.ok()) return Fail(list.status());
      for (const auto& c : *list) {
        if (c.checkpoint_id() >= info->checkpoint_id()) last = c;
      }
    }
    if (json) {
      std::cout << optimus::CheckpointJson(last) << "\n";
    } else {
      std::cout << "checkpoint " << last.checkpoint_id() << " of job " << job << " at step "
                << last.step() << ": " << optimus::CheckpointStateName(last.state())
                << (last.error().empty() ? "" : " (" + last.error() + ")") << "\n";
    }
    return last.state() == optimus::v1::CHECKPOINT_STATE_FAILED ? 1 : 0;
  }
  if (sub == "list") {
    auto list = optimus::ListCheckpointsRpc(coordinator, timeout, job);
    if (!list.ok()) return Fail(list.status());
    std::cout << (json ? optimus::RenderCheckpointsJson(*list)
                       : optimus::RenderCheckpointsTable(*list));
    return 0;
  }
  if (sub == "restore") {
    optimus::v1::RestoreCheckpointRequest req;
    req.set_job_name(job);
    req.set_checkpoint_id(checkpoint_id);
    req.set_new_job_name(as_name);
    req.set_max_chunk_bytes(max_chunk_bytes);
    // Verifying every checksum reads the whole checkpoint: allow for it.
    auto resp = optimus::RestoreCheckpointRpc(coordinator, std::max(timeout, absl::Minutes(10)),
                                              req);
    if (!resp.ok()) return Fail(resp.status());
    const std::string name = as_name.empty() ? job : as_name;
    if (json) {
      std::cout << "{\"job_id\":" << resp->job_id() << ",\"resume_step\":"
                << resp->resume_step()
                << ",\"checkpoint\":" << optimus::CheckpointJson(resp->checkpoint()) << "}\n";
    } else {
      std::cout << "restored checkpoint " << resp->checkpoint().checkpoint_id() << " of job "
                << job << " as job " << name << " (id " << resp->job_id()
                << "); workers join " << name << " and resume at step " << resp->resume_step()
                << "\n";
    }
    return 0;
  }
  if (sub == "export") {
    if (out_path.empty()) return Usage("checkpoint export needs --out=FILE");
    std::string dir = ckpt_path;
    if (dir.empty()) {
      auto list = optimus::ListCheckpointsRpc(coordinator, timeout, job);
      if (!list.ok()) return Fail(list.status());
      for (const auto& c : *list) {
        if (checkpoint_id == 0 ? c.state() == optimus::v1::CHECKPOINT_STATE_COMPLETE
                               : c.checkpoint_id() == checkpoint_id) {
          dir = c.path();
        }
      }
      if (dir.empty()) {
        return Fail(absl::NotFoundError(
            checkpoint_id == 0 ? absl::StrCat("job ", job, " has no complete checkpoint")
                               : absl::StrCat("job ", job, " has no checkpoint ", checkpoint_id)));
      }
    }
    if (absl::Status s = optimus::ExportCheckpointToTorch(dir, out_path, format); !s.ok()) {
      return Fail(s);
    }
    std::cout << "exported " << dir << " to " << out_path << "\n";
    return 0;
  }
  return Usage("unknown checkpoint command \"" + sub + "\"");
}

// `drain SHARD_ID`: marks the shard DRAINING; with --wait, polls status
// until it holds no chunk, printing each change of what is left.
int Drain(const std::string& coordinator, absl::Duration timeout,
          const std::vector<std::string>& positional, bool wait, int64_t wait_s) {
  uint64_t shard_id = 0;
  if (positional.size() != 2 || !absl::SimpleAtoi(positional[1], &shard_id) || shard_id == 0) {
    return Usage("drain needs one shard id (a positive number; see optimusctl status)");
  }
  absl::StatusOr<optimus::v1::DrainShardResponse> resp =
      optimus::DrainShardRpc(coordinator, timeout, shard_id);
  if (!resp.ok()) return Fail(resp.status());
  std::cout << "shard " << shard_id << " draining: " << resp->chunks_to_move()
            << " chunks to move\n";
  std::cout.flush();
  if (!wait) return 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(wait_s);
  std::string last_line;
  while (true) {
    absl::StatusOr<optimus::v1::StatusResponse> status =
        optimus::FetchStatus(coordinator, timeout);
    if (!status.ok()) return Fail(status.status());
    const optimus::DrainProgress p = optimus::FindDrainProgress(*status, shard_id);
    if (!p.found) return Fail(absl::NotFoundError(absl::StrCat("shard ", shard_id, " is gone")));
    if (p.drained()) {
      std::cout << "shard " << shard_id << " drained: it holds no chunk and can be stopped\n";
      return 0;
    }
    if (p.lost()) {
      return Fail(absl::UnavailableError(absl::StrCat(
          "shard ", shard_id, " went DOWN before it was drained (see optimusctl status: "
          "its chunks failed over to their backups or their jobs failed)")));
    }
    const std::string line = optimus::RenderDrainProgress(shard_id, p);
    if (line != last_line) {
      std::cout << line << "\n";
      std::cout.flush();
      last_line = line;
    }
    if (absl::Now() >= deadline) {
      return Fail(absl::DeadlineExceededError(absl::StrCat(
          "shard ", shard_id, " still holds ", p.chunks_left, " chunks after ", wait_s,
          " s (a chunk without a backup moves only once its job steps again); it keeps "
          "draining: wait again or check optimusctl status")));
    }
    absl::SleepFor(absl::Milliseconds(500));
  }
}

// `job delete NAME [--force]`.
int Job(const std::string& coordinator, absl::Duration timeout,
        const std::vector<std::string>& positional, bool force) {
  if (positional.size() < 2 || positional[1] != "delete") {
    return Usage(positional.size() < 2 ? "job needs a command: delete"
                                       : "unknown job command \"" + positional[1] + "\"");
  }
  if (positional.size() != 3 || positional[2].empty()) return Usage("job delete needs one job name");
  absl::StatusOr<optimus::v1::DeleteJobResponse> resp =
      optimus::DeleteJobRpc(coordinator, timeout, positional[2], force);
  if (!resp.ok()) return Fail(resp.status());
  std::cout << optimus::RenderJobDeleted(positional[2], *resp);
  return 0;
}

// `shard forget SHARD_ID`.
int Shard(const std::string& coordinator, absl::Duration timeout,
          const std::vector<std::string>& positional) {
  if (positional.size() < 2 || positional[1] != "forget") {
    return Usage(positional.size() < 2 ? "shard needs a command: forget"
                                       : "unknown shard command \"" + positional[1] + "\"");
  }
  uint64_t shard_id = 0;
  if (positional.size() != 3 || !absl::SimpleAtoi(positional[2], &shard_id) || shard_id == 0) {
    return Usage("shard forget needs one shard id (a positive number; see optimusctl status)");
  }
  absl::StatusOr<optimus::v1::ForgetShardResponse> resp =
      optimus::ForgetShardRpc(coordinator, timeout, shard_id);
  if (!resp.ok()) return Fail(resp.status());
  std::cout << optimus::RenderShardForgotten(*resp);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string coordinator = "127.0.0.1:7070";
  int64_t timeout_ms = 3000;
  int64_t wait_s = 300;
  bool json = false;
  bool wait = false;
  bool force = false;
  uint64_t checkpoint_id = 0;
  uint64_t max_chunk_bytes = 0;
  std::string as_name, out_path, ckpt_path;
  std::string format_name;  // Empty: the default layout.
  optimus::security::TlsOptions tls;
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
    } else if (name == "-tls_dir") {
      if (!take_value() || value.empty()) return Usage("--tls_dir needs a folder");
      tls.dir = value;
    } else if (name == "-insecure_plaintext" && !has_value) {
      tls.plaintext = true;
    } else if (name == "-json" && !has_value) {
      json = true;
    } else if (name == "-wait" && !has_value) {
      wait = true;
    } else if (name == "-force" && !has_value) {
      force = true;
    } else if (name == "-wait_s") {
      if (!take_value() || !absl::SimpleAtoi(value, &wait_s) || wait_s <= 0) {
        return Usage("--wait_s needs a positive number of seconds");
      }
    } else if (name == "-checkpoint") {
      if (!take_value() || !absl::SimpleAtoi(value, &checkpoint_id) || checkpoint_id == 0) {
        return Usage("--checkpoint needs a checkpoint id (a positive number)");
      }
    } else if (name == "-max_chunk_bytes") {
      if (!take_value() || !absl::SimpleAtoi(value, &max_chunk_bytes) || max_chunk_bytes < 4) {
        return Usage("--max_chunk_bytes needs a number of bytes (at least 4)");
      }
    } else if (name == "-as") {
      if (!take_value() || value.empty()) return Usage("--as needs a job name");
      as_name = value;
    } else if (name == "-out") {
      if (!take_value() || value.empty()) return Usage("--out needs a file name");
      out_path = value;
    } else if (name == "-format") {
      if (!take_value() || value.empty()) return Usage("--format needs optimus or torch-optim");
      format_name = value;
    } else if (name == "-path") {
      if (!take_value() || value.empty()) return Usage("--path needs a checkpoint folder");
      ckpt_path = value;
    } else {
      return Usage("unknown flag " + arg);
    }
  }
  if (positional.empty()) return Usage("no command given");
  // `checkpoint export --path` reads files only.
  const bool offline = !ckpt_path.empty();
  if (!offline) {
    if (absl::Status t = optimus::SetCliTls(tls); !t.ok()) {
      std::cerr << "optimusctl: " << t.message() << "\n";
      return 2;
    }
  }
  const std::string& command = positional[0];
  optimus::ExportFormat format = optimus::ExportFormat::kOptimus;
  if (!format_name.empty()) {
    if (command != "checkpoint" || positional.size() < 2 || positional[1] != "export") {
      return Usage("--format goes with checkpoint export only");
    }
    absl::StatusOr<optimus::ExportFormat> parsed = optimus::ParseExportFormat(format_name);
    if (!parsed.ok()) return Usage(std::string(parsed.status().message()));
    format = *parsed;
  }
  if (command == "checkpoint") {
    return Checkpoint(coordinator, absl::Milliseconds(timeout_ms), positional, json, wait,
                      checkpoint_id, as_name, max_chunk_bytes, out_path, ckpt_path, format);
  }
  if (force && command != "job") return Usage("--force goes with job delete only");
  if (command == "job") {
    if (json) return Usage("job delete has no --json output");
    return Job(coordinator, absl::Milliseconds(timeout_ms), positional, force);
  }
  if (command == "shard") {
    if (json) return Usage("shard forget has no --json output");
    return Shard(coordinator, absl::Milliseconds(timeout_ms), positional);
  }
  if (command == "drain") {
    if (json) return Usage("drain has no --json output");
    return Drain(coordinator, absl::Milliseconds(timeout_ms), positional, wait, wait_s);
  }
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
