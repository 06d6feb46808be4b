// What the coordinator's unit tests build their jobs and shards from: one
// tensor of 64-element chunks, a DPU shard's registration, and the
// coordinator's tables held by another thread the way planning holds them.
#ifndef OPTIMUS_COORDINATOR_TEST_FIXTURES_H_
#define OPTIMUS_COORDINATOR_TEST_FIXTURES_H_

#include <cstdint>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "coordinator/coordinator_core.h"
#include "proto/optimus.pb.h"

namespace optimus {
namespace coord_test {

// One tensor "w" of num_chunks chunks of 64 elements; world 1, AdamW, bf16
// grads and params (18 bytes of shard state per element), 256-byte chunks.
inline v1::CreateJobRequest OneTensorJob(const std::string& name, int num_chunks,
                                         uint32_t replication = 0) {
  v1::CreateJobRequest req;
  v1::JobSpec* s = req.mutable_spec();
  s->set_name(name);
  s->set_world_size(1);
  v1::TensorSpec* w = s->add_tensors();
  w->set_name("w");
  w->add_shape(64 * num_chunks);
  s->mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  s->mutable_optimizer()->set_lr(1e-3f);
  s->set_grad_dtype(v1::DTYPE_BF16);
  s->set_param_dtype(v1::DTYPE_BF16);
  s->set_max_chunk_bytes(256);
  s->set_replication(replication);
  return req;
}

// A DPU shard on host "node<i>" with data address "ucx-<i>".
inline v1::RegisterShardRequest DpuRegistration(int i,
                                                uint64_t memory_limit_bytes = uint64_t{1} << 30) {
  v1::RegisterShardRequest req;
  v1::ShardCapabilities* c = req.mutable_capabilities();
  c->set_kind(v1::SHARD_KIND_DPU);
  c->set_memory_limit_bytes(memory_limit_bytes);
  c->set_data_address(absl::StrCat("ucx-", i));
  c->set_hostname(absl::StrCat("node", i));
  return req;
}

// Holds the coordinator's tables from a thread of its own, as a long
// planning pass would, from construction until Release() (or destruction).
class TablesHeld {
 public:
  explicit TablesHeld(Coordinator* core)
      : thread_([this, core] {
          core->RunWithTablesLockedForTest([this] {
            held_.Notify();
            release_.WaitForNotification();
          });
        }) {
    held_.WaitForNotification();
  }
  ~TablesHeld() { Release(); }
  TablesHeld(const TablesHeld&) = delete;
  TablesHeld& operator=(const TablesHeld&) = delete;

  void Release() {
    if (!release_.HasBeenNotified()) release_.Notify();
    if (thread_.joinable()) thread_.join();
  }

 private:
  absl::Notification held_, release_;
  std::thread thread_;
};

}  // namespace coord_test
}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_TEST_FIXTURES_H_
