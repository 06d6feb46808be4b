#include "client/session.h"

#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "client/job_config.h"
#include "common/logging.h"

namespace optimus {
namespace client {
namespace {

constexpr char kLog[] = "session";

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

absl::StatusOr<int64_t> EnvInt(const char* name) {
  const std::string v = Env(name);
  if (v.empty()) return -1;
  int64_t out = 0;
  if (!absl::SimpleAtoi(v, &out) || out < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("$", name, "='", v, "' is not a whole number >= 0"));
  }
  return out;
}

// Errors worth another try while the cluster comes up: the coordinator not
// listening yet, the job not created yet, its shards not ready, a failed job
// waiting for its restore.
bool Retryable(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return true;
    default:
      return false;
  }
}

// The job spec file: the option, else $OPTIMUS_JOB_SPEC (empty: none).
std::string SpecPath(const SessionOptions& options) {
  return options.job_spec_path.empty() ? Env("OPTIMUS_JOB_SPEC") : options.job_spec_path;
}

std::string Shape(const std::vector<int64_t>& s) { return absl::StrCat("[", absl::StrJoin(s, ","), "]"); }

// The joined job must be the one this trainer describes.
absl::Status CheckTensors(const Client& client, const JobDef& def) {
  const auto& got = client.tensors();
  const std::string job = absl::StrCat("job '", def.name, "'");
  const std::string fix = absl::StrCat(
      " (a job of that name from another model? delete it with `optimusctl job delete ",
      def.name, "` or choose another job name)");
  for (size_t i = 0; i < std::min(got.size(), def.tensors.size()); ++i) {
    if (got[i].name != def.tensors[i].name || got[i].shape != def.tensors[i].shape) {
      return absl::FailedPreconditionError(absl::StrCat(
          job, " has tensor ", i, " '", got[i].name, "' ", Shape(got[i].shape),
          ", this trainer's is '", def.tensors[i].name, "' ", Shape(def.tensors[i].shape), fix));
    }
  }
  if (got.size() != def.tensors.size()) {
    return absl::FailedPreconditionError(absl::StrCat(job, " has ", got.size(),
                                                      " tensors, this trainer has ",
                                                      def.tensors.size(), fix));
  }
  return absl::OkStatus();
}

// Join with retries on one client (a failed Join leaves it unjoined).
absl::Status JoinWithRetries(Client* client, const Session& s, absl::Time deadline) {
  absl::Status last;
  absl::Duration pause = absl::Milliseconds(100);
  for (;;) {
    last = client->Join(s.job_name, s.rank, s.world_size);
    if (absl::IsPermissionDenied(last) || absl::IsUnauthenticated(last)) {
      return absl::Status(last.code(),
                          absl::StrCat(last.message(), " (give every rank the job's token: ",
                                       security::kJobTokenEnv, " or ClientOptions.job_token)"));
    }
    if (last.ok() || !Retryable(last)) return last;
    if (absl::Now() + pause > deadline) break;
    absl::SleepFor(pause);
    pause = std::min(pause * 2, absl::Seconds(2));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "rank ", s.rank, " could not join job '", s.job_name, "' in time; last error: ",
      last.ToString()));
}

}  // namespace

absl::StatusOr<SessionOptions> ResolveSessionOptions(const SessionOptions& options,
                                                     uint32_t spec_world_size) {
  SessionOptions r = options;
  if (r.coordinator.empty()) r.coordinator = Env("OPTIMUS_COORDINATOR");
  if (r.coordinator.empty()) {
    return absl::InvalidArgumentError(
        "no coordinator address: pass one, or set OPTIMUS_COORDINATOR=host:port (several: "
        "host:port,host:port)");
  }
  if (r.job_name.empty()) r.job_name = Env("OPTIMUS_JOB");
  r.job_spec_path = SpecPath(options);
  if (r.rank < 0) {
    auto v = EnvInt("RANK");
    if (!v.ok()) return v.status();
    r.rank = *v;
  }
  if (r.world_size < 0) {
    auto v = EnvInt("WORLD_SIZE");
    if (!v.ok()) return v.status();
    r.world_size = *v;
  }
  if (r.world_size < 0 && spec_world_size > 0) r.world_size = spec_world_size;
  if (r.rank < 0 && r.world_size == 1) r.rank = 0;
  if (r.rank < 0 || r.world_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank and world size unknown (rank ", r.rank, ", world size ", r.world_size,
        "): pass them, or set RANK and WORLD_SIZE as torchrun does"));
  }
  if (r.world_size == 0 || r.world_size > 65536 || r.rank >= r.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", r.rank, " of world size ",
                                                   r.world_size, " is not a valid rank"));
  }
  r.client.coordinator_address = r.coordinator;
  return r;
}

absl::StatusOr<Session> JoinOrCreate(const SessionOptions& options, JobDef def) {
  // The spec file first: its world_size may be the only one there is.
  JobConfig spec;
  const std::string spec_path = SpecPath(options);
  if (!spec_path.empty()) {
    auto loaded = LoadJobConfig(spec_path);
    if (!loaded.ok()) return loaded.status();
    spec = *std::move(loaded);
    if (spec.has_tensors) {
      return absl::InvalidArgumentError(absl::StrCat(
          spec_path, ": a trainer's job spec must not list tensors",
          spec.model.empty() ? "" : absl::StrCat(" or name a preset (model: ", spec.model, ")"),
          " (they come from the trainer's model)"));
    }
    std::vector<TensorDef> tensors = std::move(def.tensors);
    const std::string name = def.name;
    def = spec.def;
    def.tensors = std::move(tensors);
    if (!spec.has_name) def.name = name;
    if (absl::Status s = AssignGroups(spec, &def); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(spec_path, ": ", s.message()));
    }
  }
  auto resolved = ResolveSessionOptions(options, spec.has_world_size ? spec.def.world_size : 0);
  if (!resolved.ok()) return resolved.status();
  const SessionOptions& o = *resolved;
  if (!o.job_name.empty()) def.name = o.job_name;
  if (def.name.empty()) {
    return absl::InvalidArgumentError(
        "no job name: pass one, set OPTIMUS_JOB, or give `name` in the job spec");
  }
  def.world_size = static_cast<uint32_t>(o.world_size);

  Session s;
  s.rank = static_cast<uint32_t>(o.rank);
  s.world_size = static_cast<uint32_t>(o.world_size);
  s.job_name = def.name;
  ClientOptions copts = o.client;
  if (copts.transport.name == "worker") copts.transport.name = absl::StrCat("worker", s.rank);
  auto connected = Client::Connect(copts);
  if (!connected.ok()) return connected.status();
  s.client = *std::move(connected);
  const absl::Time deadline = absl::Now() + o.join_timeout;

  if (s.rank == 0) {
    absl::Status created;
    absl::Duration pause = absl::Milliseconds(100);
    for (;;) {
      created = s.client->CreateJob(def);
      if (created.ok() || absl::IsAlreadyExists(created)) break;
      if (!absl::IsUnavailable(created) && !absl::IsDeadlineExceeded(created)) return created;
      if (absl::Now() + pause > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "could not create job '", def.name, "' in time; last error: ", created.ToString()));
      }
      absl::SleepFor(pause);
      pause = std::min(pause * 2, absl::Seconds(2));
    }
    s.created = created.ok();
    OPTIMUS_LOG(Info, kLog, s.created ? "created" : "joining the existing", " job '", def.name,
                "' (", def.tensors.size(), " tensors, world size ", s.world_size, ")");
  }
  if (absl::Status j = JoinWithRetries(s.client.get(), s, deadline); !j.ok()) return j;
  if (absl::Status c = CheckTensors(*s.client, def); !c.ok()) return c;
  s.needs_init = s.rank == 0 && s.client->resume_step() == 1;
  s.def = std::move(def);
  return s;
}

absl::Status RejoinAfterRollback(const SessionOptions& options, Session* session) {
  auto resolved = ResolveSessionOptions(options, session->world_size);
  if (!resolved.ok()) return resolved.status();
  const uint64_t old_job = session->client != nullptr ? session->client->job_id() : 0;
  session->client.reset();  // Its data plane first: the new one reuses nothing.
  ClientOptions copts = resolved->client;
  if (copts.transport.name == "worker") copts.transport.name = absl::StrCat("worker", session->rank);
  const absl::Time deadline = absl::Now() + resolved->join_timeout;
  absl::Status last = absl::NotFoundError("no restored job yet");
  while (absl::Now() < deadline) {
    auto c = Client::Connect(copts);
    if (!c.ok()) return c.status();
    last = (*c)->Join(session->job_name, session->rank, session->world_size);
    if (last.ok() && (*c)->job_id() != old_job) {
      if (absl::Status t = CheckTensors(**c, session->def); !t.ok()) return t;
      session->client = *std::move(c);
      session->created = false;
      session->needs_init = false;
      OPTIMUS_LOG(Info, kLog, "rank ", session->rank, " re-joined job '", session->job_name,
                  "' restored at step ", session->client->resume_step());
      return absl::OkStatus();
    }
    if (!last.ok() && !Retryable(last)) return last;
    absl::SleepFor(absl::Milliseconds(200));
  }
  return absl::DeadlineExceededError(absl::StrCat("no restored job '", session->job_name,
                                                  "' to re-join in time; last: ", last.ToString()));
}

}  // namespace client
}  // namespace optimus
