#include "cli/status.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/container/flat_hash_map.h"
#include "absl/time/clock.h"
#include "common/coordinator_channels.h"
#include "common/grpc_limits.h"
#include "common/grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {
namespace {

const char* KindName(v1::ShardKind k) {
  switch (k) {
    case v1::SHARD_KIND_DPU: return "dpu";
    case v1::SHARD_KIND_HOST: return "host";
    default: return "unspecified";
  }
}

const char* JobStateName(v1::JobState s) {
  switch (s) {
    case v1::JOB_STATE_PENDING: return "pending";
    case v1::JOB_STATE_READY: return "ready";
    case v1::JOB_STATE_FAILED: return "failed";
    default: return "unspecified";
  }
}

const char* CkptStateName(v1::CheckpointState s) {
  switch (s) {
    case v1::CHECKPOINT_STATE_IN_PROGRESS: return "in_progress";
    case v1::CHECKPOINT_STATE_COMPLETE: return "complete";
    case v1::CHECKPOINT_STATE_FAILED: return "failed";
    default: return "unspecified";
  }
}

std::string Upper(const char* s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

std::string HumanAge(uint64_t age_ms) {
  if (age_ms < 1000) return absl::StrCat(age_ms, "ms");
  if (age_ms < 60 * 1000) return absl::StrFormat("%.1fs", age_ms / 1000.0);
  const uint64_t s = age_ms / 1000;
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
}

// Left-aligned columns separated by two spaces; numbers are right-aligned.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void RightAlign(size_t column) { right_.push_back(column); }

  std::string Render() const {
    std::vector<size_t> width(rows_[0].size(), 0);
    for (const auto& row : rows_) {
      for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
    }
    std::string out;
    for (const auto& row : rows_) {
      std::string line;
      for (size_t i = 0; i < row.size(); ++i) {
        const std::string pad(width[i] - row[i].size(), ' ');
        const bool right = std::find(right_.begin(), right_.end(), i) != right_.end();
        const bool last = i + 1 == row.size();
        if (i > 0) line += "  ";
        line += right ? pad + row[i] : (last ? row[i] : row[i] + pad);
      }
      absl::StrAppend(&out, line, "\n");
    }
    return out;
  }

 private:
  std::vector<std::vector<std::string>> rows_;
  std::vector<size_t> right_;
};


// A float for the table: shortest %g form ("0.001", "1e-08").
std::string Num(float x) { return absl::StrCat(x); }

const char* OptimizerKindName(v1::OptimizerKind k) {
  switch (k) {
    case v1::OPTIMIZER_ADAMW: return "adamw";
    case v1::OPTIMIZER_ADAM: return "adam";
    case v1::OPTIMIZER_SGD: return "sgd";
    case v1::OPTIMIZER_LION: return "lion";
    default: return "unspecified";
  }
}

bool HasBetas(v1::OptimizerKind k) { return k != v1::OPTIMIZER_SGD; }

// A group's settings as it steps: its own where set, else the optimizer's.
struct EffectiveGroup {
  float lr_mult, weight_decay, beta1, beta2, momentum;
  std::vector<std::string> overrides;  // The fields the group sets.
};

EffectiveGroup Effective(const v1::OptimizerConfig& opt, const v1::ParamGroup& g) {
  EffectiveGroup e{1.0f, opt.weight_decay(), opt.beta1(), opt.beta2(), opt.momentum(), {}};
  auto take = [&](bool set, float value, float* field, const char* name) {
    if (!set) return;
    *field = value;
    e.overrides.push_back(name);
  };
  take(g.has_lr_mult(), g.lr_mult(), &e.lr_mult, "lr_mult");
  take(g.has_weight_decay(), g.weight_decay(), &e.weight_decay, "weight_decay");
  take(g.has_beta1(), g.beta1(), &e.beta1, "beta1");
  take(g.has_beta2(), g.beta2(), &e.beta2, "beta2");
  take(g.has_momentum(), g.momentum(), &e.momentum, "momentum");
  return e;
}

// The OPTIMIZERS table: a row per parameter group, the job's own columns
// (optimizer, lr, clipping, non-finite handling, frozen tensors) on its
// first group's row. Jobs from a coordinator that does not report their
// optimizer are left out.
std::string RenderOptimizers(const v1::StatusResponse& status, int* num_jobs) {
  Table t({"JOB", "OPTIMIZER", "LR", "CLIP", "NON-FINITE", "FROZEN", "GROUP", "TENSORS",
           "PARAMS", "LR MULT", "WEIGHT DECAY", "BETAS/MOMENTUM"});
  for (size_t c : {5, 7, 8, 9, 10}) t.RightAlign(c);
  *num_jobs = 0;
  for (const v1::JobStatus& j : status.jobs()) {
    const v1::OptimizerConfig& opt = j.optimizer();
    if (opt.kind() == v1::OPTIMIZER_UNSPECIFIED) continue;
    ++*num_jobs;
    for (int g = 0; g < j.param_groups_size(); ++g) {
      const v1::ParamGroupStatus& pg = j.param_groups(g);
      const EffectiveGroup e = Effective(opt, pg.group());
      const bool first = g == 0;
      t.Add({first ? j.name() : "", first ? OptimizerKindName(opt.kind()) : "",
             first ? Num(opt.lr()) : "",
             first ? (j.max_grad_norm() > 0 ? Num(j.max_grad_norm()) : "-") : "",
             first ? (j.keep_nonfinite() ? "keep" : "skip") : "",
             first ? absl::StrCat(j.frozen_tensors()) : "",
             pg.group().name().empty() ? absl::StrCat(g) : absl::StrCat(g, " ", pg.group().name()),
             absl::StrCat(pg.num_tensors()), absl::StrCat(pg.num_elems()), Num(e.lr_mult),
             Num(e.weight_decay),
             HasBetas(opt.kind()) ? absl::StrCat(Num(e.beta1), ", ", Num(e.beta2))
                                  : absl::StrCat("momentum ", Num(e.momentum))});
    }
  }
  return t.Render();
}

// The job's optimizer, parameter groups, frozen tensors, clipping and
// non-finite handling, added to its JSON object.
void AddOptimizerJson(const v1::JobStatus& j, Json* out) {
  const v1::OptimizerConfig& opt = j.optimizer();
  Json groups = Json::array();
  for (int g = 0; g < j.param_groups_size(); ++g) {
    const v1::ParamGroupStatus& pg = j.param_groups(g);
    const EffectiveGroup e = Effective(opt, pg.group());
    groups.push_back(Json{{"index", g},
                          {"name", pg.group().name()},
                          {"num_tensors", pg.num_tensors()},
                          {"num_elems", pg.num_elems()},
                          {"lr_mult", JsonFloat(e.lr_mult)},
                          {"weight_decay", JsonFloat(e.weight_decay)},
                          {"beta1", JsonFloat(e.beta1)},
                          {"beta2", JsonFloat(e.beta2)},
                          {"momentum", JsonFloat(e.momentum)},
                          {"overrides", e.overrides}});
  }
  (*out)["optimizer"] = Json{{"kind", OptimizerKindName(opt.kind())},
                             {"lr", JsonFloat(opt.lr())},
                             {"beta1", JsonFloat(opt.beta1())},
                             {"beta2", JsonFloat(opt.beta2())},
                             {"eps", JsonFloat(opt.eps())},
                             {"weight_decay", JsonFloat(opt.weight_decay())},
                             {"momentum", JsonFloat(opt.momentum())}};
  (*out)["param_groups"] = std::move(groups);
  (*out)["frozen_tensors"] = j.frozen_tensors();
  (*out)["max_grad_norm"] = JsonFloat(j.max_grad_norm());
  (*out)["skip_nonfinite"] = !j.keep_nonfinite();
}

std::string LastCheckpointWord(const v1::JobStatus& j) {
  if (!j.has_last_checkpoint()) return "-";
  return absl::StrCat("#", j.last_checkpoint().checkpoint_id(), " step ",
                      j.last_checkpoint().step(), " ",
                      Upper(CkptStateName(j.last_checkpoint().state())));
}

std::string MemoryWord(const v1::ShardStatus& s) {
  const v1::ShardCapabilities& caps = s.capabilities();
  return absl::StrCat(
      HumanBytes(s.memory_used_bytes()), " / ", HumanBytes(caps.memory_limit_bytes()),
      caps.staging_bytes() > 0 ? absl::StrCat(" +", HumanBytes(caps.staging_bytes())) : "");
}

}  // namespace

const char* ShardStateName(v1::ShardState s) {
  switch (s) {
    case v1::SHARD_STATE_UP: return "up";
    case v1::SHARD_STATE_DRAINING: return "draining";
    case v1::SHARD_STATE_DOWN: return "down";
    default: return "unspecified";
  }
}

const char* ReplicaHealthWord(const v1::JobStatus& j) {
  if (j.replication() == 0) return j.chunks_with_backup() > 0 ? "moving" : "none";
  if (j.chunks_with_backup() < j.num_chunks()) return "degraded";
  if (j.backups_in_sync() < j.num_chunks()) return "syncing";
  return "in_sync";
}

std::string ReplicaHealth(const v1::JobStatus& j) {
  const std::string word = ReplicaHealthWord(j);
  if (word == "none") return "-";
  if (word == "moving") return absl::StrCat("moving ", j.chunks_with_backup());
  if (word == "in_sync") return absl::StrCat(j.num_chunks(), "/", j.num_chunks(), " in sync");
  return absl::StrCat(word, " ", j.backups_in_sync(), "/", j.num_chunks());
}

namespace {

absl::Mutex tls_mu;
std::optional<security::TlsMaterial> cli_tls ABSL_GUARDED_BY(tls_mu);
absl::Duration cli_connect_wait ABSL_GUARDED_BY(tls_mu) = absl::Seconds(3);
// Several addresses: their channels, kept for the process (drain --wait
// asks again and again, and follows a takeover).
absl::flat_hash_map<std::string, std::shared_ptr<CoordinatorChannels>> cli_channels
    ABSL_GUARDED_BY(tls_mu);

}  // namespace

absl::Status SetCliTls(const security::TlsOptions& options) {
  absl::StatusOr<security::TlsMaterial> m = security::LoadTls(options, false, "optimusctl");
  if (!m.ok()) return m.status();
  absl::MutexLock lock(&tls_mu);
  cli_tls = *std::move(m);
  return absl::OkStatus();
}

void SetCliConnectWait(absl::Duration wait) {
  absl::MutexLock lock(&tls_mu);
  cli_connect_wait = wait;
}

void SetCliDeadline(grpc::ClientContext* ctx, absl::Duration timeout) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
}

absl::Status CoordinatorCallStatus(const grpc::Status& s, const std::string& address) {
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
      s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::UnavailableError(
        absl::StrCat("cannot reach coordinator at ", address, ": ", s.error_message()));
  }
  return FromGrpc(s);
}

void ReleaseCliChannels() {
  absl::flat_hash_map<std::string, std::shared_ptr<CoordinatorChannels>> channels;
  {
    absl::MutexLock lock(&tls_mu);
    channels.swap(cli_channels);
  }
  // Destroyed here, outside the lock (the destructor joins a thread).
}

std::shared_ptr<grpc::Channel> CoordinatorChannel(const std::string& address) {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  absl::Duration wait = absl::Seconds(3);
  {
    absl::MutexLock lock(&tls_mu);
    if (!cli_tls.has_value()) {
      absl::StatusOr<security::TlsMaterial> m =
          security::LoadTls(security::TlsOptions(), false, "optimusctl");
      if (!m.ok()) {
        std::fprintf(stderr, "optimusctl: %s\n", std::string(m.status().message()).c_str());
        return grpc::CreateChannel(address, grpc::SslCredentials(grpc::SslCredentialsOptions()));
      }
      cli_tls = *std::move(m);
    }
    credentials = security::ChannelCredentials(*cli_tls);
    wait = cli_connect_wait;
  }
  // One address (or one the flag's check would have refused): one channel.
  absl::StatusOr<std::vector<std::string>> list = ParseCoordinatorAddresses(address);
  if (!list.ok() || list->size() == 1) return CreateLimitedChannel(address, credentials);
  std::shared_ptr<CoordinatorChannels> channels;
  {
    absl::MutexLock lock(&tls_mu);
    std::shared_ptr<CoordinatorChannels>& c = cli_channels[address];
    if (c == nullptr) {
      absl::StatusOr<std::shared_ptr<CoordinatorChannels>> made =
          CoordinatorChannels::Create(address, credentials, LimitedChannelArgs());
      if (!made.ok()) return CreateLimitedChannel(list->front(), credentials);
      c = *std::move(made);
    }
    channels = c;
  }
  // The leader is the one that accepts a connection (standbys do not
  // listen). None within the wait (a takeover under way): the current
  // one, whose call then fails UNAVAILABLE naming every address.
  channels->WaitForConnected(absl::Now() + wait);
  return channels->channel(channels->current());
}

absl::StatusOr<v1::StatusResponse> FetchStatus(const std::string& address,
                                               absl::Duration timeout, const StatusQuery& query) {
  auto channel = CoordinatorChannel(address);
  auto stub = v1::Coordinator::NewStub(channel);
  v1::StatusRequest req;
  for (v1::ShardState st : query.shard_states) req.add_shard_states(st);
  req.set_page_size(query.page_size);
  v1::StatusResponse all;
  for (int page = 0;; ++page) {
    grpc::ClientContext ctx;
    SetCliDeadline(&ctx, timeout);
    v1::StatusResponse resp;
    if (absl::Status err = CoordinatorCallStatus(stub->Status(&ctx, req, &resp), address);
        !err.ok()) {
      if (absl::IsUnavailable(err)) return err;
      return absl::Status(err.code(),
                          absl::StrCat("coordinator at ", address, ": ", err.message()));
    }
    if (page == 0) {
      all = std::move(resp);
    } else {
      for (v1::ShardStatus& sh : *resp.mutable_shards()) *all.add_shards() = std::move(sh);
    }
    const std::string next = page == 0 ? all.next_page_token() : resp.next_page_token();
    // Shard ids only grow: a token that does not move on would loop.
    if (next.empty() || next == req.page_token()) break;
    req.set_page_token(next);
  }
  all.clear_next_page_token();
  if (!query.shard_states.empty()) {
    auto* shards = all.mutable_shards();
    for (int i = shards->size() - 1; i >= 0; --i) {
      const v1::ShardState st = shards->Get(i).state();
      if (std::find(query.shard_states.begin(), query.shard_states.end(), st) ==
          query.shard_states.end()) {
        shards->DeleteSubrange(i, 1);
      }
    }
  }
  return all;
}

absl::StatusOr<v1::ShardState> ParseShardState(const std::string& name) {
  std::string lower = name;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "up") return v1::SHARD_STATE_UP;
  if (lower == "down") return v1::SHARD_STATE_DOWN;
  if (lower == "draining") return v1::SHARD_STATE_DRAINING;
  return absl::InvalidArgumentError(
      absl::StrCat("\"", name, "\" is not a shard state (up, down or draining)"));
}

std::string HumanBytes(uint64_t size_bytes) {
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (size_bytes < 1024) return absl::StrCat(size_bytes, " B");
  double v = static_cast<double>(size_bytes) / 1024;
  int unit = 0;
  while (v >= 1024 && unit < 5) {
    v /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", v, kUnits[unit]);
}

std::string RenderShardsTable(const v1::StatusResponse& status) {
  Table shards({"ID", "KIND", "ARCH", "HOST", "STATE", "MEM USED/LIMIT +STAGING", "PLANNED",
                "CHUNKS", "BACKUPS", "TRANSPORTS", "LEASE AGE"});
  shards.RightAlign(0);
  shards.RightAlign(7);
  shards.RightAlign(8);
  for (const v1::ShardStatus& s : status.shards()) {
    const v1::ShardCapabilities& caps = s.capabilities();
    shards.Add({absl::StrCat(s.shard_id()), KindName(caps.kind()),
                caps.arch().empty() ? "-" : caps.arch(),
                caps.hostname().empty() ? "-" : caps.hostname(), Upper(ShardStateName(s.state())),
                MemoryWord(s), HumanBytes(s.memory_planned_bytes()),
                absl::StrCat(s.chunks_owned()), absl::StrCat(s.backup_chunks()),
                s.transports().empty() ? "-" : s.transports(), HumanAge(s.lease_age_ms())});
  }
  return shards.Render();
}

std::string RenderJobsTable(const v1::StatusResponse& status) {
  Table jobs({"ID", "NAME", "STATE", "WORKERS", "STEP", "TENSORS", "PARAMS", "STATE BYTES",
              "CHUNKS", "EPOCH", "REPL", "REPLICAS", "LAST CHECKPOINT"});
  for (size_t c : {0, 4, 5, 6, 8, 9, 10}) jobs.RightAlign(c);
  for (const v1::JobStatus& j : status.jobs()) {
    jobs.Add({absl::StrCat(j.job_id()), j.name(), Upper(JobStateName(j.state())),
              absl::StrCat(j.workers_joined(), "/", j.world_size()),
              absl::StrCat(j.current_step()), absl::StrCat(j.num_tensors()),
              absl::StrCat(j.num_params()), HumanBytes(j.state_bytes()),
              absl::StrCat(j.num_chunks()), absl::StrCat(j.map_epoch()),
              absl::StrCat(j.replication()), ReplicaHealth(j), LastCheckpointWord(j)});
  }
  return jobs.Render();
}

std::string RenderStatusTable(const v1::StatusResponse& status) {
  std::string out = absl::StrCat("SHARDS (", status.shards_size(), ")\n");
  absl::StrAppend(&out, RenderShardsTable(status), "\nJOBS (", status.jobs_size(), ")\n",
                  RenderJobsTable(status));
  for (const v1::JobStatus& j : status.jobs()) {
    if (!j.rollback_error().empty()) {
      absl::StrAppend(&out, "job ", j.name(), " (", j.job_id(),
                      ") was not rolled back: ", j.rollback_error(), "\n");
    }
  }
  int with_optimizer = 0;
  const std::string optimizers = RenderOptimizers(status, &with_optimizer);
  if (with_optimizer > 0) absl::StrAppend(&out, "\nOPTIMIZERS (", with_optimizer, ")\n", optimizers);
  return out;
}

namespace {

// "Field:  value" lines, the values aligned.
std::string Fields(const std::vector<std::pair<std::string, std::string>>& rows) {
  size_t width = 0;
  for (const auto& r : rows) width = std::max(width, r.first.size());
  std::string out;
  for (const auto& r : rows) {
    absl::StrAppend(&out, r.first, ":", std::string(width - r.first.size() + 2, ' '), r.second,
                    "\n");
  }
  return out;
}

}  // namespace

std::string RenderJobDetail(const v1::JobStatus& j) {
  std::vector<std::pair<std::string, std::string>> rows = {
      {"Name", j.name()},
      {"ID", absl::StrCat(j.job_id())},
      {"State", Upper(JobStateName(j.state()))},
      {"Workers", absl::StrCat(j.workers_joined(), " of ", j.world_size(), " joined")},
      {"Step", absl::StrCat(j.current_step(), " (lowest step applied over its shards)")},
      {"Tensors", absl::StrCat(j.num_tensors(), " (", j.num_params(), " parameters, ",
                               j.frozen_tensors(), " frozen)")},
      {"State bytes", HumanBytes(j.state_bytes())},
      {"Chunks", absl::StrCat(j.num_chunks(), " (map epoch ", j.map_epoch(), ")")},
      {"Replication", absl::StrCat(j.replication(), " (replicas: ", ReplicaHealth(j), ")")},
      {"Last checkpoint",
       j.has_last_checkpoint() && !j.last_checkpoint().error().empty()
           ? absl::StrCat(LastCheckpointWord(j), ": ", j.last_checkpoint().error())
           : LastCheckpointWord(j)},
  };
  if (!j.rollback_error().empty()) rows.push_back({"Rollback error", j.rollback_error()});
  std::string out = Fields(rows);
  v1::StatusResponse one;
  *one.add_jobs() = j;
  int with_optimizer = 0;
  const std::string optimizers = RenderOptimizers(one, &with_optimizer);
  if (with_optimizer > 0) absl::StrAppend(&out, "\nOPTIMIZER\n", optimizers);
  return out;
}

std::string RenderShardDetail(const v1::ShardStatus& s) {
  const v1::ShardCapabilities& caps = s.capabilities();
  return Fields({
      {"ID", absl::StrCat(s.shard_id())},
      {"Kind", KindName(caps.kind())},
      {"Arch", caps.arch().empty() ? "-" : caps.arch()},
      {"Cores", absl::StrCat(caps.cores())},
      {"Host", caps.hostname().empty() ? "-" : caps.hostname()},
      {"State", Upper(ShardStateName(s.state()))},
      {"Memory used", absl::StrCat(HumanBytes(s.memory_used_bytes()), " of ",
                                   HumanBytes(caps.memory_limit_bytes()))},
      {"Memory planned", HumanBytes(s.memory_planned_bytes())},
      {"Staging", HumanBytes(caps.staging_bytes())},
      {"Chunks", absl::StrCat(s.chunks_owned(), " (", s.backup_chunks(), " of them backups)")},
      {"Transports", s.transports().empty() ? "-" : s.transports()},
      {"Lease age", HumanAge(s.lease_age_ms())},
  });
}

const v1::JobStatus* FindJob(const v1::StatusResponse& status, const std::string& name) {
  for (const v1::JobStatus& j : status.jobs()) {
    if (j.name() == name) return &j;
  }
  return nullptr;
}

const v1::ShardStatus* FindShard(const v1::StatusResponse& status, uint64_t shard_id) {
  for (const v1::ShardStatus& s : status.shards()) {
    if (s.shard_id() == shard_id) return &s;
  }
  return nullptr;
}

Json ShardToJson(const v1::ShardStatus& s) {
  const v1::ShardCapabilities& caps = s.capabilities();
  return Json{{"shard_id", s.shard_id()},
              {"kind", KindName(caps.kind())},
              {"arch", caps.arch()},
              {"cores", caps.cores()},
              {"hostname", caps.hostname()},
              {"state", ShardStateName(s.state())},
              {"memory_used_bytes", s.memory_used_bytes()},
              {"memory_planned_bytes", s.memory_planned_bytes()},
              {"memory_limit_bytes", caps.memory_limit_bytes()},
              {"staging_bytes", caps.staging_bytes()},
              {"chunks_owned", s.chunks_owned()},
              {"backup_chunks", s.backup_chunks()},
              {"transports", s.transports()},
              {"lease_age_ms", s.lease_age_ms()}};
}

Json JobToJson(const v1::JobStatus& j) {
  Json out{{"job_id", j.job_id()},
           {"name", j.name()},
           {"state", JobStateName(j.state())},
           {"world_size", j.world_size()},
           {"workers_joined", j.workers_joined()},
           {"current_step", j.current_step()},
           {"num_tensors", j.num_tensors()},
           {"num_params", j.num_params()},
           {"state_bytes", j.state_bytes()},
           {"map_epoch", j.map_epoch()},
           {"replication", j.replication()},
           {"num_chunks", j.num_chunks()},
           {"chunks_with_backup", j.chunks_with_backup()},
           {"backups_in_sync", j.backups_in_sync()},
           {"replicas", ReplicaHealthWord(j)}};
  if (j.has_last_checkpoint()) {
    const v1::CheckpointInfo& c = j.last_checkpoint();
    out["last_checkpoint"] = Json{{"checkpoint_id", c.checkpoint_id()},
                                  {"step", c.step()},
                                  {"state", CkptStateName(c.state())},
                                  {"error", c.error()}};
  } else {
    out["last_checkpoint"] = nullptr;
  }
  out["rollback_error"] = j.rollback_error();
  AddOptimizerJson(j, &out);
  return out;
}

Json StatusToJson(const v1::StatusResponse& status) {
  Json shards = Json::array();
  for (const v1::ShardStatus& s : status.shards()) shards.push_back(ShardToJson(s));
  Json jobs = Json::array();
  for (const v1::JobStatus& j : status.jobs()) jobs.push_back(JobToJson(j));
  return Json{{"shards", std::move(shards)}, {"jobs", std::move(jobs)}};
}

std::string RenderStatusJson(const v1::StatusResponse& status) {
  return ToJsonText(StatusToJson(status));
}

}  // namespace optimus
