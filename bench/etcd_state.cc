// bench/etcd_state: what the coordinator's state costs in etcd (issue 16
// item 4): one real etcd member on loopback (Debian's /usr/bin/etcd, with
// its fsync), a state of N DPU shards (UCX-sized data addresses) and one
// LLaMA-70B-sized job (69e9 parameters in chunks of 2 Mi elements, with a
// backup per chunk, every shard's endpoint in its map), written by
// EtcdStateStore as the coordinator writes it.
//
// One JSON line per N: the state's bytes, the keys in etcd, and the time
// and Txns of: the first save (everything), a save after one shard changed
// (what a registration or a DOWN costs), a save after the job's map changed
// (a failover: the job's parts rewritten), and a Load (what a standby
// reads when it takes over).
//
// Usage: bazel run -c opt //bench:etcd_state -- [--shards=1000,16384]
// (figures and the command used: docs/benchmarks.md)
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/json.h"
#include "coordinator/etcd_client.h"
#include "coordinator/etcd_state_store.h"
#include "coordinator/etcd_test_cluster.h"
#include "proto/optimus.pb.h"

ABSL_FLAG(std::string, shards, "1000,16384", "numbers of shards N, one line each");
ABSL_FLAG(double, params, 69e9, "parameters of the one job");

namespace optimus {
namespace {

constexpr uint64_t kChunkElems = uint64_t{2} << 20;

v1::CoordinatorState MakeState(int n, double params) {
  v1::CoordinatorState s;
  s.set_next_shard_id(n + 1);
  s.set_next_job_id(2);
  s.set_data_plane_key(std::string(44, 'k'));
  // A UCX worker address over TCP and shared memory is a few hundred bytes.
  const std::string address_tail(200, 'u');
  for (int i = 1; i <= n; ++i) {
    v1::PersistedShard* sh = s.add_shards();
    sh->set_shard_id(i);
    v1::ShardCapabilities* c = sh->mutable_capabilities();
    c->set_kind(v1::SHARD_KIND_DPU);
    c->set_hostname(absl::StrCat("dpu-node-", i));
    c->set_data_address(absl::StrCat(i, address_tail));
    c->set_memory_limit_bytes(uint64_t{16} << 30);
    sh->set_state(v1::SHARD_STATE_UP);
    sh->set_identity(absl::StrCat("shard-", i));
  }
  v1::PersistedJob* j = s.add_jobs();
  j->set_job_id(1);
  j->mutable_spec()->set_name("llama-70b");
  j->mutable_spec()->set_world_size(1024);
  j->set_state(v1::JOB_STATE_READY);
  j->set_num_params(static_cast<uint64_t>(params));
  j->set_token(std::string(44, 't'));
  v1::ShardMap* m = j->mutable_map();
  m->set_job_id(1);
  m->set_epoch(1);
  const uint64_t chunks = (static_cast<uint64_t>(params) + kChunkElems - 1) / kChunkElems;
  for (uint64_t c = 0; c < chunks; ++c) {
    v1::ChunkPlacement* p = m->add_chunks();
    p->set_tensor(static_cast<uint32_t>(c / 64));
    p->set_chunk(static_cast<uint32_t>(c % 64));
    p->set_offset_elems((c % 64) * kChunkElems);
    p->set_num_elems(kChunkElems);
    p->set_shard_id(1 + c % n);
    p->set_backup_shard_id(1 + (c + 1) % n);
  }
  for (int i = 1; i <= n; ++i) {
    v1::ShardEndpoint* e = m->add_shards();
    e->set_shard_id(i);
    e->set_data_address(absl::StrCat(i, address_tail));
    e->set_kind(v1::SHARD_KIND_DPU);
  }
  return s;
}

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

int Run() {
  auto cluster = EtcdTestCluster::Start(1, "etcd_state_bench");
  if (!cluster.ok()) {
    std::fprintf(stderr, "etcd_state: %s\n", cluster.status().ToString().c_str());
    return 1;
  }
  EtcdClientOptions o;
  o.endpoints = (*cluster)->endpoints();
  o.call_timeout = absl::Seconds(30);
  auto client = EtcdClient::Create(o);
  if (!client.ok()) return 1;
  int run = 0;
  for (absl::string_view n_text : absl::StrSplit(absl::GetFlag(FLAGS_shards), ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(n_text, &n) || n <= 0) {
      std::fprintf(stderr, "etcd_state: bad --shards entry %s\n", std::string(n_text).c_str());
      return 2;
    }
    EtcdStateStoreOptions so;
    so.prefix = absl::StrCat("/bench", run++);
    EtcdStateStore store(client->get(), EtcdFence{}, so);
    v1::CoordinatorState state = MakeState(n, absl::GetFlag(FLAGS_params));
    const std::string bytes = state.SerializeAsString();

    Json line;
    line["bench"] = "etcd_state";
    line["shards"] = n;
    line["chunks"] = state.jobs(0).map().chunks_size();
    line["state_bytes"] = bytes.size();
    line["shard_bytes"] = state.shards(0).ByteSizeLong();
    line["job_bytes"] = state.jobs(0).ByteSizeLong();

    absl::Time t = absl::Now();
    absl::Status s = store.Save(bytes);
    line["first_save_ms"] = JsonRound(Ms(absl::Now() - t), 1);
    line["first_save_txns"] = store.last_save().txns;
    line["keys"] = store.last_save().puts;
    if (!s.ok()) line["error"] = s.ToString();

    state.mutable_shards(n / 2)->set_state(v1::SHARD_STATE_DOWN);
    t = absl::Now();
    s = store.Save(state.SerializeAsString());
    line["one_shard_save_ms"] = JsonRound(Ms(absl::Now() - t), 2);
    line["one_shard_save_puts"] = store.last_save().puts;
    if (!s.ok()) line["error"] = s.ToString();

    state.mutable_jobs(0)->mutable_map()->set_epoch(2);
    state.mutable_jobs(0)->mutable_map()->mutable_chunks(0)->set_shard_id(2);
    t = absl::Now();
    s = store.Save(state.SerializeAsString());
    line["map_change_save_ms"] = JsonRound(Ms(absl::Now() - t), 1);
    line["map_change_txns"] = store.last_save().txns;
    line["map_change_puts"] = store.last_save().puts;
    line["map_change_deletes"] = store.last_save().deletes;
    if (!s.ok()) line["error"] = s.ToString();

    EtcdStateStore reader(client->get(), EtcdFence{}, so);
    t = absl::Now();
    auto loaded = reader.Load();
    line["load_ms"] = JsonRound(Ms(absl::Now() - t), 1);
    line["load_equal"] = loaded.ok() && loaded->has_value() &&
                         **loaded == state.SerializeAsString();
    std::printf("%s\n", JsonDump(line).c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace optimus

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return optimus::Run();
}
