#include "coordinator/state_writer.h"

#include <utility>

#include "common/logging.h"

namespace optimus {
namespace {
constexpr char kLog[] = "coord";
}  // namespace

StateWriter::StateWriter(StateStore* store) : store_(store) {
  thread_ = std::thread([this] { Run(); });
}

StateWriter::~StateWriter() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

uint64_t StateWriter::Submit(std::string bytes) {
  absl::MutexLock lock(&mu_);
  pending_ = std::move(bytes);  // An older snapshot still queued is superseded.
  pending_seq_ = ++submitted_seq_;
  return pending_seq_;
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
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return pending_.has_value() || stop_;
      };
      mu_.Await(absl::Condition(&ready));
      if (!pending_.has_value()) return;  // Stopping with nothing left to write.
      bytes = *std::move(pending_);
      pending_.reset();
      seq = pending_seq_;
    }
    // The slow part, with no lock held: Submit and WaitDurable go on.
    const absl::Status s = store_->Save(bytes);
    if (!s.ok()) {
      OPTIMUS_LOG(Warning, kLog, "state snapshot ", seq, " not saved to ", store_->Describe(),
                  ": ", s.ToString());
    }
    absl::MutexLock lock(&mu_);
    attempted_seq_ = seq;
    if (s.ok()) {
      durable_seq_ = seq;
    } else {
      last_error_ = s;
    }
  }
}

}  // namespace optimus
