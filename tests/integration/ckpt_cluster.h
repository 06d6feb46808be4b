// Test harness for checkpoint tests: a real coordinator and S real shard
// servers in this process sharing one checkpoint folder, W worker clients
// over UCX on loopback, and the coordinator's checkpoint RPCs over gRPC.
// Not thread-safe except where noted; owned by one test.
#ifndef OPTIMUS_TESTS_INTEGRATION_CKPT_CLUSTER_H_
#define OPTIMUS_TESTS_INTEGRATION_CKPT_CLUSTER_H_

#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/dtype.h"
#include "common/grpc_status.h"
#include "coordinator/coordinator.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/cpu/optimizer.h"
#include "proto/optimus.grpc.pb.h"
#include "server/shard_server.h"

namespace optimus {
namespace testing_ckpt {

constexpr uint32_t kWorkers = 2;
constexpr absl::Duration kWait = absl::Seconds(30);

inline float Grad(float param, uint64_t step, uint32_t rank, size_t i) {
  return 0.5f * param + std::sin(0.001f * static_cast<float>(i) + 0.1f * step + rank);
}
inline float Init(size_t i) { return std::cos(0.37f * static_cast<float>(i)); }

inline std::string NewTempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string tmpl = absl::StrCat(base != nullptr ? base : "/tmp", "/ckptXXXXXX");
  EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

inline client::JobDef MakeJob(const std::string& name, uint64_t max_chunk_bytes = 64 * 1024) {
  client::JobDef def;
  def.name = name;
  def.world_size = kWorkers;
  def.tensors = {{"weight", {200, 257}}, {"bias", {37}}};
  def.optimizer.kind = client::Optimizer::kAdamW;
  def.optimizer.lr = 1e-2f;
  def.optimizer.weight_decay = 0.1f;
  def.grad_dtype = DType::kBf16;
  def.param_dtype = DType::kBf16;
  def.max_chunk_bytes = max_chunk_bytes;
  return def;
}

class CkptCluster {
 public:
  CkptCluster(const std::string& ckpt_dir, int num_shards, uint64_t writer_bytes_per_second = 0) {
    CoordinatorOptions copts;
    copts.checkpoint_dir = ckpt_dir;
    copts.sweep_interval = absl::Milliseconds(50);
    auto coord = CoordinatorServer::Start(copts);
    EXPECT_TRUE(coord.ok()) << coord.status();
    coord_ = std::move(*coord);
    for (int i = 0; i < num_shards; ++i) {
      server::ShardServerOptions s;
      s.coordinator_address = coord_->address();
      s.memory_limit_bytes = 256ull << 20;
      s.transport.net_devices = "lo";
      s.transport.name = "shard";
      s.heartbeat_interval = absl::Milliseconds(50);
      s.checkpoint_dir = ckpt_dir;
      s.checkpoint_max_bytes_per_second = writer_bytes_per_second;
      auto shard = server::ShardServer::Start(s);
      EXPECT_TRUE(shard.ok()) << shard.status();
      shards_.push_back(std::move(*shard));
    }
    stub_ = v1::Coordinator::NewStub(
        grpc::CreateChannel(coord_->address(), grpc::InsecureChannelCredentials()));
  }

  ~CkptCluster() {
    clients_.clear();
    shards_.clear();
    coord_.reset();
  }

  CoordinatorServer* coord() { return coord_.get(); }
  // Stops shard i as if its machine died: no more heartbeats or replies.
  void StopShard(size_t i) { shards_[i]->Shutdown(); }
  client::Client* client(uint32_t r) { return clients_[r].get(); }
  server::ShardServer* shard(size_t i) { return shards_[i].get(); }
  size_t num_shards() const { return shards_.size(); }

  // Connects W new clients; rank 0 creates the job and sends initial values.
  void CreateAndJoin(const client::JobDef& def) {
    ConnectClients();
    ASSERT_TRUE(clients_[0]->CreateJob(def).ok());
    JoinAll(def.name);
    for (uint32_t t = 0; t < clients_[0]->tensors().size(); ++t) {
      std::vector<float> v(clients_[0]->tensors()[t].num_elems);
      for (size_t i = 0; i < v.size(); ++i) v[i] = Init(i + t * 100000);
      ASSERT_TRUE(clients_[0]->InitTensor(t, v.data(), v.size()).ok());
    }
  }

  void ConnectClients() {
    clients_.clear();
    for (uint32_t r = 0; r < kWorkers; ++r) {
      client::ClientOptions o;
      o.coordinator_address = coord_->address();
      o.transport.net_devices = "lo";
      o.transport.name = "worker";
      auto c = client::Client::Connect(o);
      ASSERT_TRUE(c.ok()) << c.status();
      clients_.push_back(std::move(*c));
    }
  }

  void JoinAll(const std::string& name) {
    for (uint32_t r = 0; r < kWorkers; ++r) {
      absl::Status s = clients_[r]->Join(name, r, kWorkers);
      ASSERT_TRUE(s.ok()) << s;
    }
  }

  // Tensor t at `version`, as raw param-dtype bytes.
  std::vector<uint8_t> Pull(uint32_t t, uint64_t version, uint32_t rank = 0) {
    client::Client* c = clients_[rank].get();
    const size_t n = c->tensors()[t].num_elems;
    std::vector<uint8_t> raw(n * DTypeSize(c->param_dtype()));
    auto ticket = c->Pull(t, version, raw.data(), n);
    EXPECT_TRUE(ticket.ok()) << ticket.status();
    if (!ticket.ok()) return raw;
    absl::Status s = c->Wait(*ticket, kWait);
    EXPECT_TRUE(s.ok()) << "pull of tensor " << t << " version " << version << ": " << s;
    return raw;
  }

  // `step_done`, if set, gets the time each step finished (all tensors pushed).
  void RunWorker(uint32_t rank, uint64_t first_step, uint64_t last_step,
                 std::vector<absl::Time>* step_done = nullptr) {
    client::Client* c = clients_[rank].get();
    // A push's buffer must stay as it is until the next version of its
    // tensor is pulled (the client resends it after a failover).
    std::vector<std::vector<uint8_t>> grads(c->tensors().size());
    for (uint64_t step = first_step; step <= last_step; ++step) {
      for (uint32_t t = 0; t < c->tensors().size(); ++t) {
        const size_t n = c->tensors()[t].num_elems;
        std::vector<uint8_t> raw = Pull(t, step, rank);
        std::vector<float> p(n), g(n);
        kernels::CastToFp32(raw.data(), c->param_dtype(), n, p.data());
        for (size_t i = 0; i < n; ++i) g[i] = Grad(p[i], step, rank, i + t * 100000);
        std::vector<uint8_t>& gb = grads[t];
        gb.resize(n * DTypeSize(c->grad_dtype()));
        kernels::CastFromFp32(g.data(), n, gb.data(), c->grad_dtype());
        auto ticket = c->Push(t, step, gb.data(), n);
        ASSERT_TRUE(ticket.ok()) << ticket.status();
        absl::Status s = c->Wait(*ticket, kWait);
        ASSERT_TRUE(s.ok()) << "rank " << rank << " step " << step << ": " << s;
      }
      if (step_done != nullptr) step_done->push_back(absl::Now());
    }
  }

  // Every worker runs steps first..last (inclusive).
  void Train(uint64_t first_step, uint64_t last_step,
             std::vector<absl::Time>* rank0_step_done = nullptr) {
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < kWorkers; ++r) {
      threads.emplace_back([this, r, first_step, last_step, rank0_step_done] {
        RunWorker(r, first_step, last_step, r == 0 ? rank0_step_done : nullptr);
      });
    }
    for (auto& t : threads) t.join();
  }

  // ---- Checkpoint RPCs ----
  absl::StatusOr<v1::CheckpointInfo> CreateCheckpoint(const std::string& job) {
    v1::CreateCheckpointRequest req;
    req.set_job_name(job);
    v1::CreateCheckpointResponse resp;
    grpc::ClientContext ctx;
    absl::Status s = FromGrpc(stub_->CreateCheckpoint(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp.checkpoint();
  }

  std::vector<v1::CheckpointInfo> List(const std::string& job) {
    v1::ListCheckpointsRequest req;
    req.set_job_name(job);
    v1::ListCheckpointsResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub_->ListCheckpoints(&ctx, req, &resp).ok());
    return {resp.checkpoints().begin(), resp.checkpoints().end()};
  }

  // Waits until checkpoint `id` of `job` (or the retry that replaced it, if
  // a shard had passed its step: a larger id) is no longer IN_PROGRESS and
  // returns its info.
  v1::CheckpointInfo WaitDone(const std::string& job, uint64_t id,
                              absl::Duration timeout = kWait) {
    const absl::Time give_up = absl::Now() + timeout;
    v1::CheckpointInfo last;
    while (absl::Now() < give_up) {
      bool busy = false, found = false;
      for (const auto& c : List(job)) {
        if (c.checkpoint_id() < id) continue;
        found = true;
        last = c;
        busy |= c.state() == v1::CHECKPOINT_STATE_IN_PROGRESS;
      }
      if (found && !busy) return last;
      absl::SleepFor(absl::Milliseconds(20));
    }
    ADD_FAILURE() << "checkpoint " << id << " of " << job << " still in progress";
    return last;
  }

  absl::StatusOr<v1::RestoreCheckpointResponse> Restore(const std::string& job, uint64_t id,
                                                        const std::string& new_name,
                                                        uint64_t max_chunk_bytes = 0) {
    v1::RestoreCheckpointRequest req;
    req.set_job_name(job);
    req.set_checkpoint_id(id);
    req.set_new_job_name(new_name);
    req.set_max_chunk_bytes(max_chunk_bytes);
    v1::RestoreCheckpointResponse resp;
    grpc::ClientContext ctx;
    absl::Status s = FromGrpc(stub_->RestoreCheckpoint(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp;
  }

  v1::StatusResponse Status() {
    v1::StatusResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub_->Status(&ctx, v1::StatusRequest(), &resp).ok());
    return resp;
  }

  // Waits until the coordinator has seen every shard of `job` at >= step
  // applied (heartbeats lag the data plane).
  void WaitApplied(const std::string& job, uint64_t step) {
    const absl::Time give_up = absl::Now() + kWait;
    while (absl::Now() < give_up) {
      const v1::StatusResponse status = Status();
      for (const auto& j : status.jobs()) {
        if (j.name() == job && j.current_step() >= step) return;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    ADD_FAILURE() << "job " << job << " never reported step " << step;
  }

 private:
  std::unique_ptr<CoordinatorServer> coord_;
  std::vector<std::unique_ptr<server::ShardServer>> shards_;
  std::vector<std::unique_ptr<client::Client>> clients_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

}  // namespace testing_ckpt
}  // namespace optimus

#endif  // OPTIMUS_TESTS_INTEGRATION_CKPT_CLUSTER_H_
