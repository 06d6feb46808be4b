// `optimusctl shard list|describe|drain|forget`, and `optimusctl drain`.
#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/command_util.h"
#include "cli/commands.h"
#include "cli/drain.h"
#include "cli/lifecycle.h"
#include "cli/status.h"

namespace optimus {
namespace {

struct DrainFlags {
  uint64_t shard_id = 0;
  bool wait = false;
  int64_t wait_s = 300;
};

// Marks the shard DRAINING; with --wait, polls status until it holds no
// chunk, printing each change of what is left to stderr. A poll that finds
// no coordinator (a restart, a takeover) is tried again until --wait_s.
int Drain(const GlobalFlags& g, const DrainFlags& f) {
  if (!UseCoordinator(g).ok()) return 2;
  const uint64_t id = f.shard_id;
  absl::StatusOr<v1::DrainShardResponse> resp = DrainShardRpc(g.coordinator, g.timeout(), id);
  if (!resp.ok()) return Fail(resp.status());
  std::cout << "shard " << id << " draining: " << resp->chunks_to_move() << " chunks to move\n";
  std::cout.flush();
  if (!f.wait) return 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(f.wait_s);
  // A drained shard stays DRAINING until it is stopped, then DOWN: asking
  // for those states alone keeps each poll small in a large cluster.
  StatusQuery query;
  query.shard_states = {v1::SHARD_STATE_DRAINING, v1::SHARD_STATE_DOWN};
  std::string last_line;
  while (true) {
    absl::StatusOr<v1::StatusResponse> status = FetchStatus(g.coordinator, g.timeout(), query);
    if (absl::IsUnavailable(status.status()) && absl::Now() < deadline) {
      // The coordinator restarting, or its standby taking over (the drain
      // is in its state and goes on under the new leader): ask again.
      const std::string line = absl::StrCat(status.status().message(), "; asking again");
      if (line != last_line) {
        std::cerr << line << "\n";
        last_line = line;
      }
      absl::SleepFor(absl::Milliseconds(500));
      continue;
    }
    if (!status.ok()) return Fail(status.status());
    const DrainProgress p = FindDrainProgress(*status, id);
    if (!p.found) return Fail(absl::NotFoundError(absl::StrCat("shard ", id, " is gone")));
    if (p.drained()) {
      std::cout << "shard " << id << " drained: it holds no chunk and can be stopped\n";
      return 0;
    }
    if (p.lost()) {
      return Fail(absl::UnavailableError(absl::StrCat(
          "shard ", id, " went DOWN before it was drained (see optimusctl status: "
          "its chunks failed over to their backups or their jobs failed)")));
    }
    const std::string line = RenderDrainProgress(id, p);
    if (line != last_line) {
      std::cerr << line << "\n";
      last_line = line;
    }
    if (absl::Now() >= deadline) {
      return Fail(absl::DeadlineExceededError(absl::StrCat(
          "shard ", id, " still holds ", p.chunks_left, " chunks after ", f.wait_s,
          " s (a chunk without a backup moves only once its job steps again); it keeps "
          "draining: wait again or check optimusctl status")));
    }
    absl::SleepFor(absl::Milliseconds(500));
  }
}

void AddDrain(CLI::App* parent, const std::string& description, GlobalFlags* g,
              int* exit_code) {
  CLI::App* cmd = parent->add_subcommand("drain", description);
  auto f = std::make_shared<DrainFlags>();
  cmd->add_option("SHARD_ID", f->shard_id, "the shard's id (see optimusctl shard list)")
      ->required()
      ->check(PositiveWhole("a shard id"));
  cmd->add_flag("--wait", f->wait,
                "until it holds no chunk (exit 0) or --wait_s pass (exit 1); progress on "
                "stderr");
  cmd->add_option("--wait_s", f->wait_s, "how long --wait waits, in seconds")
      ->type_name("N")
      ->capture_default_str()
      ->check(PositiveWhole("a number of seconds"));
  OnRun(cmd, exit_code, [g, f]() -> int { return Drain(*g, *f); });
}

constexpr char kDrainHelp[] =
    "move every chunk off the shard while training runs (promote its backups, seed new "
    "ones); then stop the shard";

}  // namespace

void AddShardCommands(CLI::App* root, GlobalFlags* g, int* exit_code) {
  CLI::App* shard = root->add_subcommand("shard", "list, describe, drain and forget shards");
  shard->require_subcommand(1);

  {
    CLI::App* cmd = shard->add_subcommand(
        "list", "every shard (or those in --state): kind, host, state, memory, chunks, "
                "backups, transports, lease");
    auto format = std::make_shared<OutputFormat>(OutputFormat::kTable);
    AddOutputFlags(cmd, format.get());
    auto query = std::make_shared<StatusQuery>();
    cmd->add_option_function<std::vector<std::string>>(
           "--state",
           [query](const std::vector<std::string>& names) {
             for (const std::string& n : names) {
               const v1::ShardState st = *ParseShardState(n);
               if (std::find(query->shard_states.begin(), query->shard_states.end(), st) ==
                   query->shard_states.end()) {
                 query->shard_states.push_back(st);
               }
             }
           },
           "only shards in these states: up, down, draining (comma-separated or repeated; "
           "the coordinator filters)")
        ->type_name("STATE")
        ->delimiter(',')
        ->check(CLI::Validator(
            [](std::string& name) -> std::string {
              absl::StatusOr<v1::ShardState> st = ParseShardState(name);
              return st.ok() ? std::string() : std::string(st.status().message());
            },
            "up|down|draining", "shard state"));
    AddPageSizeFlag(cmd, query.get());
    OnStatusRun(cmd, exit_code, g, query, [format](const v1::StatusResponse& st) -> int {
      PrintResult(
          *format,
          [&] {
            Json shards = Json::array();
            for (const v1::ShardStatus& s : st.shards()) shards.push_back(ShardToJson(s));
            return Json{{"shards", std::move(shards)}};
          },
          [&] { return RenderShardsTable(st); });
      return 0;
    });
  }

  {
    CLI::App* cmd = shard->add_subcommand("describe", "one shard, field by field");
    struct Flags {
      uint64_t shard_id = 0;
      OutputFormat format = OutputFormat::kTable;
    };
    auto f = std::make_shared<Flags>();
    cmd->add_option("SHARD_ID", f->shard_id, "the shard's id")
        ->required()
        ->check(PositiveWhole("a shard id"));
    AddOutputFlags(cmd, &f->format);
    OnStatusRun(cmd, exit_code, g, [f](const v1::StatusResponse& st) -> int {
      const v1::ShardStatus* s = FindShard(st, f->shard_id);
      if (s == nullptr) {
        return Fail(absl::NotFoundError(absl::StrCat("no shard with id ", f->shard_id)));
      }
      PrintResult(
          f->format, [&] { return ShardToJson(*s); }, [&] { return RenderShardDetail(*s); });
      return 0;
    });
  }

  AddDrain(shard, kDrainHelp, g, exit_code);

  {
    CLI::App* cmd = shard->add_subcommand(
        "forget", "remove a DOWN shard from the tables now (DOWN shards also leave on their "
                  "own after the coordinator's --down_shard_grace)");
    auto id = std::make_shared<uint64_t>(0);
    cmd->add_option("SHARD_ID", *id, "the shard's id")
        ->required()
        ->check(PositiveWhole("a shard id"));
    OnRun(cmd, exit_code, [g, id]() -> int {
      if (!UseCoordinator(*g).ok()) return 2;
      absl::StatusOr<v1::ForgetShardResponse> resp =
          ForgetShardRpc(g->coordinator, g->timeout(), *id);
      if (!resp.ok()) return Fail(resp.status());
      std::cout << RenderShardForgotten(*resp);
      return 0;
    });
  }

  // Scripts and docs say `optimusctl drain ID`.
  AddDrain(root, absl::StrCat("the same as `shard drain`: ", kDrainHelp), g, exit_code);
}

}  // namespace optimus
