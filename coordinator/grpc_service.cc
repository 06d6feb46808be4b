#include "coordinator/grpc_service.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <utility>

#include "absl/time/time.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/security.h"
#include "google/protobuf/unknown_field_set.h"

namespace optimus {

std::vector<uint64_t> CoordinatorService::errors() const {
  std::vector<uint64_t> out(kNumCodes);
  for (int c = 0; c < kNumCodes; ++c) out[c] = errors_[c].load();
  return out;
}


using security::Caller;
using security::Role;

namespace {

std::string Who(const Caller& c) {
  if (!c.identity.empty()) return absl::StrCat("\"", c.identity, "\"");
  return c.token.empty() ? "a caller with no certificate and no job token"
                         : "a caller with a job token";
}

}  // namespace

grpc::Status CoordinatorService::Refuse(const Caller& c, absl::string_view rpc,
                                        absl::string_view needs) {
  const bool anonymous = c.role == Role::kNone && c.token.empty();
  const auto code = anonymous ? grpc::StatusCode::UNAUTHENTICATED
                              : grpc::StatusCode::PERMISSION_DENIED;
  errors_[static_cast<int>(code)].fetch_add(1);
  OPTIMUS_LOG(Warning, "coord", "refused ", rpc, " from ", Who(c), " (", c.peer, "): needs ",
              needs);
  return grpc::Status(code, absl::StrCat(rpc, " refused: needs ", needs, "; the caller is ",
                                         Who(c)));
}

void CoordinatorService::RunBelowHeartbeats() {
  // Once per thread; only gRPC's synchronous threads and the map readers
  // come here (heartbeats run on gRPC's callback threads, which keep the
  // default priority).
  thread_local bool lowered = false;
  if (lowered) return;
  lowered = true;
  // Raising one's niceness needs no privilege; failing leaves it as is.
  setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), kSyncCallNice);
}

bool CoordinatorService::Abandoned(const grpc::ServerContextBase& ctx) {
  return ctx.IsCancelled() || ctx.deadline() < std::chrono::system_clock::now();
}

grpc::Status CoordinatorService::Dropped(absl::string_view rpc) {
  dropped_.fetch_add(1);
  errors_[static_cast<int>(absl::StatusCode::kCancelled)].fetch_add(1);
  return grpc::Status(grpc::StatusCode::CANCELLED,
                      absl::StrCat(rpc, " dropped: the caller gave up before it was served"));
}

grpc::Status CoordinatorService::MapReadsBusy(grpc::ServerContextBase* ctx,
                                              absl::string_view rpc) {
  map_reads_refused_.fetch_add(1);
  errors_[static_cast<int>(absl::StatusCode::kResourceExhausted)].fetch_add(1);
  ctx->AddTrailingMetadata(kRetryAfterKey, absl::StrCat(kMapReadRetryAfterMs));
  return grpc::Status(
      grpc::StatusCode::RESOURCE_EXHAUSTED,
      absl::StrCat(rpc, " refused: the coordinator is serving its most map reads at once (",
                   max_map_reads_, ", --max_concurrent_map_reads) and has ",
                   max_queued_map_reads_, " more waiting (--max_queued_map_reads); nothing was "
                   "read: retry after about ", kMapReadRetryAfterMs, " ms, with jittered backoff"));
}

CoordinatorService::Workers::Workers(int n) {
  for (int i = 0; i < std::max(1, n); ++i) threads_.emplace_back([this] { Loop(); });
}

CoordinatorService::Workers::~Workers() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void CoordinatorService::Workers::Run(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  tasks_.push_back(std::move(task));
}

void CoordinatorService::Workers::Loop() {
  RunBelowHeartbeats();
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &Workers::HasWork));
      if (tasks_.empty()) return;  // Stopping, and nothing left to run.
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

grpc::ServerUnaryReactor* CoordinatorService::ReadMap(grpc::CallbackServerContext* ctx,
                                                      absl::string_view rpc,
                                                      std::function<grpc::Status()> serve) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (Abandoned(*ctx)) {
    reactor->Finish(Dropped(rpc));
    return reactor;
  }
  // Before anything that takes the tables' lock: a read refused here costs
  // the coordinator next to nothing.
  if (map_reads_.fetch_add(1) >= max_map_reads_ + max_queued_map_reads_) {
    map_reads_.fetch_sub(1);
    reactor->Finish(MapReadsBusy(ctx, rpc));
    return reactor;
  }
  map_readers_.Run([this, ctx, reactor, rpc, serve = std::move(serve)] {
    // A read whose client gave up while it waited is not served.
    grpc::Status s = Abandoned(*ctx) ? Dropped(rpc) : serve();
    map_reads_.fetch_sub(1);
    reactor->Finish(std::move(s));
  });
  return reactor;
}

Caller CoordinatorService::Identify(grpc::ServerContextBase* ctx) const {
  Caller c = security::IdentifyCaller(*ctx, plaintext_);
  c.peer = ctx->peer();
  return c;
}

bool CoordinatorService::MayReadJob(const Caller& c, uint64_t job_id) {
  if (c.role == Role::kAdmin || c.role == Role::kShard) return true;
  if (c.token.empty()) return false;
  // A job that is gone reads as NOT_FOUND to any token holder: its workers
  // learn it ended (a roll-back can replace a FAILED job before they ever
  // saw it FAILED) and re-join by name, where their token is checked.
  return core_->JobTokenMatches(job_id, c.token) || core_->JobGone(job_id);
}

bool CoordinatorService::MayUseJobNamed(const Caller& c, const std::string& name,
                                        bool unknown_ok) {
  if (c.role == Role::kAdmin) return true;
  if (c.token.empty()) return false;
  const std::optional<bool> match = core_->JobTokenMatchesByName(name, c.token);
  return match.has_value() ? *match : unknown_ok;
}

constexpr char kNeedsAdmin[] = "the admin role (a client certificate \"admin:<who>\")";
constexpr char kNeedsShard[] = "the shard role (a client certificate \"shard:<who>\")";
constexpr char kNeedsJob[] = "the job's token (authorization: Bearer <token>) or the admin role";

template <typename T>
grpc::Status CoordinatorService::Reply(absl::StatusOr<T> result, T* resp) {
  if (!result.ok()) {
    const int code = static_cast<int>(result.status().code());
    if (code > 0 && code < kNumCodes) errors_[code].fetch_add(1);
    return ToGrpc(result.status());
  }
  *resp = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::RegisterShard(grpc::ServerContext* ctx,
                                               const v1::RegisterShardRequest* req,
                                               v1::RegisterShardResponse* resp) {
  const InProgress in_progress(this);
  if (Abandoned(*ctx)) return Dropped("RegisterShard");
  const Caller c = Identify(ctx);
  if (c.role != Role::kShard && !plaintext_) return Refuse(c, "RegisterShard", kNeedsShard);
  // Checked again once the tables are free: a registration waits for
  // other changes to be durable first.
  grpc::Status s = Reply(core_->RegisterShard(*req, plaintext_ ? std::string() : c.identity,
                                              [ctx] { return Abandoned(*ctx); }),
                         resp);
  if (s.error_code() == grpc::StatusCode::CANCELLED) dropped_.fetch_add(1);
  return s;
}

grpc::ServerUnaryReactor* CoordinatorService::Heartbeat(grpc::CallbackServerContext* ctx,
                                                        const v1::HeartbeatRequest* req,
                                                        v1::HeartbeatResponse* resp) {
  // Served on the callback thread itself: the core's Heartbeat waits at
  // most a few milliseconds for the tables, then answers from the lease
  // table.
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(HeartbeatCall(ctx, *req, resp));
  return reactor;
}

grpc::Status CoordinatorService::HeartbeatCall(grpc::ServerContextBase* ctx,
                                               const v1::HeartbeatRequest& req,
                                               v1::HeartbeatResponse* resp) {
  if (Abandoned(*ctx)) return Dropped("Heartbeat");
  if (!plaintext_) {
    const Caller c = Identify(ctx);
    if (c.role != Role::kShard) return Refuse(c, "Heartbeat", kNeedsShard);
    if (!core_->ShardIdentityMatches(req.shard_id(), c.identity)) {
      return Refuse(c, "Heartbeat",
                    absl::StrCat("the certificate that registered shard ", req.shard_id()));
    }
  }
  *resp = core_->Heartbeat(req);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::CreateJob(grpc::ServerContext* ctx,
                                           const v1::CreateJobRequest* req,
                                           v1::CreateJobResponse* resp) {
  const InProgress in_progress(this);
  if (Abandoned(*ctx)) return Dropped("CreateJob");
  const Caller c = Identify(ctx);
  if (c.role != Role::kAdmin && c.role != Role::kTrainer) {
    return Refuse(c, "CreateJob",
                  "the admin or trainer role (a client certificate \"trainer:<who>\")");
  }
  grpc::Status s = Reply(core_->CreateJob(*req, [ctx] { return Abandoned(*ctx); }), resp);
  if (s.error_code() == grpc::StatusCode::CANCELLED) dropped_.fetch_add(1);
  return s;
}

grpc::Status CoordinatorService::JoinJob(grpc::ServerContext* ctx,
                                         const v1::JoinJobRequest* req,
                                         v1::JoinJobResponse* resp) {
  const InProgress in_progress(this);
  if (Abandoned(*ctx)) return Dropped("JoinJob");
  const Caller c = Identify(ctx);
  // A job not created yet is NOT_FOUND to a caller with a token: its ranks
  // wait for rank 0 to create it.
  if (!MayUseJobNamed(c, req->job_name(), /*unknown_ok=*/true)) {
    return Refuse(c, "JoinJob", kNeedsJob);
  }
  return Reply(core_->JoinJob(*req), resp);
}

grpc::Status CoordinatorService::LeaveJob(grpc::ServerContext* ctx,
                                          const v1::LeaveJobRequest* req,
                                          v1::LeaveJobResponse* resp) {
  const InProgress in_progress(this);
  if (Abandoned(*ctx)) return Dropped("LeaveJob");
  const Caller c = Identify(ctx);
  if (!MayUseJobNamed(c, req->job_name(), false)) return Refuse(c, "LeaveJob", kNeedsJob);
  return Reply(core_->LeaveJob(*req), resp);
}

grpc::Status CoordinatorService::DeleteJob(grpc::ServerContext* ctx,
                                           const v1::DeleteJobRequest* req,
                                           v1::DeleteJobResponse* resp) {
  const InProgress in_progress(this);
  if (Abandoned(*ctx)) return Dropped("DeleteJob");
  const Caller c = Identify(ctx);
  if (c.role != Role::kAdmin) return Refuse(c, "DeleteJob", kNeedsAdmin);
  return Reply(core_->DeleteJob(*req), resp);
}

grpc::ServerUnaryReactor* CoordinatorService::GetJob(grpc::CallbackServerContext* ctx,
                                                     const v1::GetJobRequest* req,
                                                     v1::GetJobResponse* resp) {
  return ReadMap(ctx, "GetJob", [this, ctx, req, resp] { return GetJobCall(ctx, req, resp); });
}

grpc::Status CoordinatorService::GetJobCall(grpc::ServerContextBase* ctx,
                                            const v1::GetJobRequest* req,
                                            v1::GetJobResponse* resp) {
  if (while_reading_map_ != nullptr) while_reading_map_();
  const Caller c = Identify(ctx);
  if (req->for_shard_id() != 0) {
    // One shard's part of the map: asked by that shard (its certificate),
    // or an admin. Plain-text mode has no identities: everyone is admin.
    const bool is_that_shard =
        c.role == Role::kShard && core_->ShardIdentityMatches(req->for_shard_id(), c.identity);
    if (c.role != Role::kAdmin && !is_that_shard) {
      return Refuse(c, "GetJob",
                    absl::StrCat("for_shard_id ", req->for_shard_id(),
                                 ": the certificate that registered that shard, or the admin "
                                 "role (leave for_shard_id 0 for the whole map)"));
    }
  } else if (!MayReadJob(c, req->job_id())) {
    return Refuse(c, "GetJob", kNeedsJob);
  }
  absl::StatusOr<Coordinator::SerializedJob> job =
      core_->GetJobSerialized(req->job_id(), req->for_shard_id(), req->known_epoch());
  if (!job.ok()) return Reply(absl::StatusOr<v1::GetJobResponse>(job.status()), resp);
  // The spec and the map go out as the bytes the epoch's first fetch made:
  // set as unknown fields 2 and 3 (length-delimited, as a sub-message is
  // on the wire), they are copied into the answer as they are, and the
  // caller parses them as JobSpec and ShardMap.
  *resp = std::move(job->head);
  google::protobuf::UnknownFieldSet* raw = resp->GetReflection()->MutableUnknownFields(resp);
  if (job->spec != nullptr) {
    raw->AddLengthDelimited(v1::GetJobResponse::kSpecFieldNumber, *job->spec);
  }
  raw->AddLengthDelimited(v1::GetJobResponse::kMapFieldNumber, *job->map);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* CoordinatorService::GetShardMap(grpc::CallbackServerContext* ctx,
                                                          const v1::GetShardMapRequest* req,
                                                          v1::ShardMap* resp) {
  return ReadMap(ctx, "GetShardMap",
                 [this, ctx, req, resp] { return GetShardMapCall(ctx, req, resp); });
}

grpc::Status CoordinatorService::GetShardMapCall(grpc::ServerContextBase* ctx,
                                                 const v1::GetShardMapRequest* req,
                                                 v1::ShardMap* resp) {
  if (while_reading_map_ != nullptr) while_reading_map_();
  const Caller c = Identify(ctx);
  if (!MayReadJob(c, req->job_id())) return Refuse(c, "GetShardMap", kNeedsJob);
  return Reply(core_->GetShardMap(req->job_id()), resp);
}

grpc::Status CoordinatorService::WatchShardMap(grpc::ServerContext* ctx,
                                               const v1::WatchShardMapRequest* req,
                                               grpc::ServerWriter<v1::ShardMap>* writer) {
  RunBelowHeartbeats();
  if (Abandoned(*ctx)) return Dropped("WatchShardMap");
  const Caller c = Identify(ctx);
  if (!MayReadJob(c, req->job_id())) return Refuse(c, "WatchShardMap", kNeedsJob);
  // Each watch holds a server thread while it lasts; past the limit the
  // threads left are for every other call.
  if (watchers_.fetch_add(1) >= max_watchers_) {
    watchers_.fetch_sub(1);
    errors_[static_cast<int>(absl::StatusCode::kResourceExhausted)].fetch_add(1);
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("the coordinator serves at most ", max_watchers_,
                                     " map watches at a time (half of --max_rpc_threads); "
                                     "retry later or poll GetShardMap"));
  }
  struct Release {
    std::atomic<int>* n;
    ~Release() { n->fetch_sub(1); }
  } release{&watchers_};
  // The sync API has no cancellation callback: wait in short slices and
  // poll IsCancelled() between them.
  constexpr absl::Duration kPollInterval = absl::Milliseconds(100);
  uint64_t after_epoch = req->after_epoch();
  while (!ctx->IsCancelled()) {
    absl::StatusOr<std::optional<v1::ShardMap>> map =
        core_->WaitForShardMap(req->job_id(), after_epoch, kPollInterval, req->deltas());
    if (!map.ok()) return ToGrpc(map.status());
    if (!map->has_value()) continue;
    if (!writer->Write(**map)) return grpc::Status::OK;  // Client went away.
    after_epoch = (*map)->epoch();
  }
  return grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled by the client");
}

grpc::Status CoordinatorService::Status(grpc::ServerContext* ctx, const v1::StatusRequest* req,
                                        v1::StatusResponse* resp) {
  const InProgress in_progress(this);
  if (Abandoned(*ctx)) return Dropped("Status");
  const Caller c = Identify(ctx);
  const bool everything = c.role == Role::kAdmin || c.role == Role::kShard;
  if (!everything && c.token.empty()) return Refuse(c, "Status", kNeedsJob);
  if (grpc::Status s = Reply(core_->StatusPage(*req), resp); !s.ok()) return s;
  core_->FillLastCheckpoints(resp);
  if (!everything) {
    // A job token sees its own job, and no shard.
    resp->clear_shards();
    resp->clear_next_page_token();
    resp->clear_matching_shards();
    auto* jobs = resp->mutable_jobs();
    for (int i = jobs->size() - 1; i >= 0; --i) {
      if (!core_->JobTokenMatches(jobs->Get(i).job_id(), c.token)) jobs->DeleteSubrange(i, 1);
    }
  }
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::CreateCheckpoint(grpc::ServerContext* ctx,
                                                  const v1::CreateCheckpointRequest* req,
                                                  v1::CreateCheckpointResponse* resp) {
  const InProgress in_progress(this);
  if (Abandoned(*ctx)) return Dropped("CreateCheckpoint");
  const Caller c = Identify(ctx);
  if (!MayUseJobNamed(c, req->job_name(), false)) return Refuse(c, "CreateCheckpoint", kNeedsJob);
  return Reply(core_->CreateCheckpoint(*req), resp);
}

grpc::Status CoordinatorService::ListCheckpoints(grpc::ServerContext* ctx,
                                                 const v1::ListCheckpointsRequest* req,
                                                 v1::ListCheckpointsResponse* resp) {
  const InProgress in_progress(this);
  if (Abandoned(*ctx)) return Dropped("ListCheckpoints");
  const Caller c = Identify(ctx);
  if (!MayUseJobNamed(c, req->job_name(), false)) return Refuse(c, "ListCheckpoints", kNeedsJob);
  *resp = core_->ListCheckpoints(*req);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::RestoreCheckpoint(grpc::ServerContext* ctx,
                                                   const v1::RestoreCheckpointRequest* req,
                                                   v1::RestoreCheckpointResponse* resp) {
  const InProgress in_progress(this);
  if (Abandoned(*ctx)) return Dropped("RestoreCheckpoint");
  const Caller c = Identify(ctx);
  if (c.role != Role::kAdmin) return Refuse(c, "RestoreCheckpoint", kNeedsAdmin);
  return Reply(core_->RestoreCheckpoint(*req), resp);
}

grpc::Status CoordinatorService::DrainShard(grpc::ServerContext* ctx,
                                            const v1::DrainShardRequest* req,
                                            v1::DrainShardResponse* resp) {
  const InProgress in_progress(this);
  if (Abandoned(*ctx)) return Dropped("DrainShard");
  const Caller c = Identify(ctx);
  if (c.role != Role::kAdmin) return Refuse(c, "DrainShard", kNeedsAdmin);
  return Reply(core_->DrainShard(*req), resp);
}

grpc::Status CoordinatorService::ForgetShard(grpc::ServerContext* ctx,
                                             const v1::ForgetShardRequest* req,
                                             v1::ForgetShardResponse* resp) {
  const InProgress in_progress(this);
  if (Abandoned(*ctx)) return Dropped("ForgetShard");
  const Caller c = Identify(ctx);
  if (c.role != Role::kAdmin) return Refuse(c, "ForgetShard", kNeedsAdmin);
  return Reply(core_->ForgetShard(*req), resp);
}

}  // namespace optimus
