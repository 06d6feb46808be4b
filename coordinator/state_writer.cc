#include "coordinator/state_writer.h"

#include <algorithm>
#include <utility>

#include "common/logging.h"

namespace optimus {
namespace {
constexpr char kLog[] = "coord";
}  // namespace

StateWriter::StateWriter(StateStore* store, Source source)
    : store_(store), source_(std::move(source)) {
  thread_ = std::thread([this] { Run(); });
}

StateWriter::~StateWriter() { Close(); }

void StateWriter::Close() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

uint64_t StateWriter::Submit(std::string bytes) {
  absl::MutexLock lock(&mu_);
  pending_ = std::move(bytes);  // An older snapshot still queued is superseded.
  pending_seq_ = ++submitted_seq_;
  return pending_seq_;
}

uint64_t StateWriter::MarkChanged() {
  absl::MutexLock lock(&mu_);
  pull_wanted_ = true;
  return ++submitted_seq_;
}

uint64_t StateWriter::submitted_seq() const {
  absl::MutexLock lock(&mu_);
  return submitted_seq_;
}

absl::Status StateWriter::WaitDurable(uint64_t seq) {
  absl::MutexLock lock(&mu_);
  auto covered = [this, seq]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return durable_seq_ >= seq || attempted_seq_ >= seq;
  };
  mu_.Await(absl::Condition(&covered));
  if (durable_seq_ >= seq) return absl::OkStatus();
  return last_error_;
}

uint64_t StateWriter::durable_seq() const {
  absl::MutexLock lock(&mu_);
  return durable_seq_;
}

void StateWriter::Run() {
  while (true) {
    std::string bytes;
    uint64_t seq;
    bool pull = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return pending_.has_value() || (pull_wanted_ && source_ != nullptr) || stop_;
      };
      mu_.Await(absl::Condition(&ready));
      if (pull_wanted_ && source_ != nullptr) {
        // Taken now, the state holds every change marked so far (and
        // whatever a pushed snapshot holds: it is older).
        pull_wanted_ = false;
        pending_.reset();
        pull = true;
      } else if (!pending_.has_value()) {
        return;  // Stopping with nothing left to write.
      } else {
        bytes = *std::move(pending_);
        pending_.reset();
        seq = pending_seq_;
      }
    }
    if (pull) {
      absl::StatusOr<Pulled> pulled = source_();
      if (!pulled.ok()) {
        OPTIMUS_LOG(Warning, kLog, "state not serialized: ", pulled.status().ToString());
        absl::MutexLock lock(&mu_);
        attempted_seq_ = submitted_seq_;
        last_error_ = pulled.status();
        continue;
      }
      bytes = std::move(pulled->bytes);
      seq = pulled->seq;
    }
    // The slow part, with no lock held: Submit and WaitDurable go on.
    const absl::Status s = store_->Save(bytes);
    if (!s.ok()) {
      OPTIMUS_LOG(Warning, kLog, "state snapshot ", seq, " not saved to ", store_->Describe(),
                  ": ", s.ToString());
    }
    absl::MutexLock lock(&mu_);
    attempted_seq_ = std::max(attempted_seq_, seq);
    if (s.ok()) {
      durable_seq_ = std::max(durable_seq_, seq);
    } else {
      last_error_ = s;
    }
  }
}

}  // namespace optimus
