#include "client/torch/trainer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace optimus {
namespace client {
namespace {
constexpr char kLog[] = "trainer";
}  // namespace

Trainer::Trainer(torch::nn::Module* module, TrainerOptions options, Session session)
    : module_(module), options_(std::move(options)), session_(std::move(session)) {}

Trainer::~Trainer() {
  sync_.reset();  // Before the client it borrows.
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(torch::nn::Module* module,
                                                         TrainerOptions options) {
  if (module == nullptr) return absl::InvalidArgumentError("Trainer::Create: no module");
  JobDef def = options.job;
  def.tensors = TensorDefsFromModule(*module);
  auto session = JoinOrCreate(options.session, std::move(def));
  if (!session.ok()) return session.status();
  std::unique_ptr<Trainer> t(new Trainer(module, std::move(options), *std::move(session)));
  auto sync = ModuleSync::Create(t->client(), module, t->options_.sync);
  if (!sync.ok()) return sync.status();
  t->sync_ = *std::move(sync);
  if (t->session_.needs_init) {
    if (absl::Status s = t->sync_->InitFromModule(); !s.ok()) return s;
  }
  t->step_ = t->client()->resume_step();
  return t;
}

absl::Status Trainer::Recover(const absl::Status& why) {
  armed_ = false;
  // A job that failed (a shard lost without a replica) answers UNAVAILABLE;
  // one already replaced by its restore, NOT_FOUND. Anything else is the
  // caller's to see.
  const bool lost = absl::IsUnavailable(why) || absl::IsNotFound(why);
  if (!options_.follow_rollback || !lost) return why;
  OPTIMUS_LOG(Warning, kLog, "rank ", session_.rank, " step ", step_, " failed (",
              why.ToString(), "); re-joining the job restored from its last checkpoint");
  sync_.reset();
  if (absl::Status s = RejoinAfterRollback(options_.session, &session_); !s.ok()) {
    return absl::Status(why.code(), absl::StrCat(why.message(), "; re-joining: ",
                                                     s.message()));
  }
  auto sync = ModuleSync::Create(client(), module_, options_.sync);
  if (!sync.ok()) return sync.status();
  sync_ = *std::move(sync);
  step_ = client()->resume_step();
  ++rollbacks_;
  OPTIMUS_LOG(Info, kLog, "rank ", session_.rank, " resuming at step ", step_);
  return absl::OkStatus();
}

absl::Status Trainer::BeginStep(const PushOptions& options) {
  if (armed_) {
    return absl::FailedPreconditionError(
        absl::StrCat("BeginStep: step ", step_, " is under way (call EndStep first)"));
  }
  if (sync_ == nullptr) return absl::FailedPreconditionError("BeginStep: the trainer failed");
  absl::Status s = sync_->WaitParams(step_, options_.timeout);
  if (s.ok()) s = sync_->ArmStep(step_, options_.timeout, options);
  if (!s.ok()) {
    if (absl::Status r = Recover(s); !r.ok()) return r;
    // Re-joined: the restored step's parameters, armed.
    return BeginStep(options);
  }
  armed_ = true;
  return absl::OkStatus();
}

absl::Status Trainer::EndStep() {
  if (!armed_) return absl::FailedPreconditionError("EndStep without BeginStep");
  armed_ = false;
  if (absl::Status s = sync_->FinishStep(); !s.ok()) return Recover(s);
  ++step_;
  return absl::OkStatus();
}

absl::Status Trainer::Finish() {
  if (armed_) return absl::FailedPreconditionError("Finish: a step is under way (call EndStep)");
  if (sync_ == nullptr) return absl::FailedPreconditionError("Finish: the trainer failed");
  if (absl::Status s = sync_->Synchronize(options_.timeout); !s.ok()) return s;
  // Leaving only lets the job be deleted without --force: a coordinator
  // that cannot be reached (Leave tries again for a while) is reported.
  if (absl::Status left = client()->Leave(); !left.ok()) {
    OPTIMUS_LOG(Warning, kLog, "rank ", session_.rank, " could not leave job '",
                session_.job_name, "' (", left.ToString(),
                "): it can be deleted with optimusctl job delete --force");
  }
  return absl::OkStatus();
}

}  // namespace client
}  // namespace optimus
