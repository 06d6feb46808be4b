// Fuzz target: a real shard server (server/shard_server.h) answering
// arbitrary data-plane messages from a peer on the in-process loopback
// transport, as any process that reaches its UCX port could send them.
// Each input gets a fresh small job (tests/fuzz/shard_input.h), loaded
// through a fake coordinator link, then its records are sent as requests
// (or as replies, which the shard reads as answers to its replication
// forwards); then the job is released. Fails on a crash or sanitizer
// report, when the shard stops answering (a request sent after the input's
// must be answered within kAnswerWait), and when a released job's memory is
// not given back (within kAnswerWait).
//
// The shard, its link and the peer live for the whole fuzzing process; only
// the job is per input, so one input's effects reach the next only through
// what the shard keeps after a job is released (which should be nothing).
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/checkpoint_files.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "common/wire.h"
#include "server/coordinator_link.h"
#include "server/shard_server.h"
#include "tests/fuzz/shard_input.h"
#include "transport/loopback.h"

namespace optimus {
namespace fuzz {
namespace {

// Generous: the fuzzer runs under ASan on a loaded 2-core machine.
constexpr absl::Duration kAnswerWait = absl::Seconds(20);

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "shard_requests_fuzzer: %s\n", what.c_str());
  std::abort();
}

// The coordinator as the shard sees it: one job at a time, released on
// request. Heartbeat reports are kept for the harness to wait on.
class FakeLink : public server::CoordinatorLink {
 public:
  absl::StatusOr<server::Registered> Register(const server::ShardRegistration&) override {
    absl::MutexLock lock(&mu_);
    return server::Registered{++shard_id_, 600000};
  }
  absl::StatusOr<server::HeartbeatReply> Heartbeat(const server::HeartbeatReport& report) override {
    absl::MutexLock lock(&mu_);
    last_ = report;
    ++beats_;
    server::HeartbeatReply reply;
    for (const auto& [id, d] : jobs_) reply.assignments.push_back({id, d.map.epoch});
    // Released jobs the shard no longer reports need not be told again.
    std::set<uint64_t> held;
    for (const server::JobReport& j : report.jobs) held.insert(j.job_id);
    std::vector<uint64_t> still;
    for (uint64_t id : released_) {
      if (held.count(id) != 0) still.push_back(id);
    }
    released_ = still;
    reply.released_jobs = released_;
    return reply;
  }
  absl::StatusOr<server::JobDescription> GetJob(uint64_t job_id, uint64_t) override {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError("no such job");
    return it->second;
  }

  uint64_t shard_id() {
    absl::MutexLock lock(&mu_);
    return shard_id_;
  }
  void SetJob(const server::JobDescription& d) {
    absl::MutexLock lock(&mu_);
    jobs_[d.config.job_id] = d;
  }
  void Release(uint64_t job_id) {
    absl::MutexLock lock(&mu_);
    jobs_.erase(job_id);
    released_.push_back(job_id);
  }
  // Waits (from a fresh heartbeat on) until the shard reports holding the
  // job (`held`) or not.
  bool AwaitJob(uint64_t job_id, bool held) {
    absl::MutexLock lock(&mu_);
    const uint64_t after = beats_;
    auto there = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (beats_ <= after) return false;
      bool has = false;
      for (const server::JobReport& j : last_.jobs) has = has || j.job_id == job_id;
      return has == held;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&there), kAnswerWait);
  }

 private:
  absl::Mutex mu_;
  uint64_t shard_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, server::JobDescription> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> released_ ABSL_GUARDED_BY(mu_);
  server::HeartbeatReport last_ ABSL_GUARDED_BY(mu_);
  uint64_t beats_ ABSL_GUARDED_BY(mu_) = 0;
};

// The other end: sends the records, answers the shard's replication
// forwards as a well-behaved backup would, and waits for the sentinel's
// answer.
class Peer {
 public:
  explicit Peer(const std::shared_ptr<transport::LoopbackFabric>& fabric) {
    transport::WorkerOptions o;
    o.loopback = fabric;
    o.name = "fuzz-peer";
    auto w = transport::Worker::Create(o);
    if (!w.ok()) Fail(w.status().ToString());
    worker_ = *std::move(w);
    worker_->SetHandler(wire::kAmReply, [this](transport::IncomingMessage& m) {
      auto r = wire::ParseReply(m.header());
      if (!r.ok()) Fail(absl::StrCat("the shard sent a malformed reply: ", r.status().ToString()));
      if (verbose_) {
        std::fprintf(stderr, "reply to request %llu: %s flags=%u version=%llu\n",
                     static_cast<unsigned long long>(r->header.request_id),
                     r->status.ToString().c_str(), r->header.flags,
                     static_cast<unsigned long long>(r->header.param_version));
      }
      absl::MutexLock lock(&mu_);
      answered_.insert(r->header.request_id);
    });
    worker_->SetHandler(wire::kAmRequest, [this](transport::IncomingMessage& m) {
      auto h = wire::ParseRequestHeader(m.header());
      if (!h.ok()) Fail(absl::StrCat("the shard sent a malformed request: ", h.status().ToString()));
      const std::string ok = wire::EncodeReply(h->request_id, absl::OkStatus(), h->step, 0);
      worker_->Send(m.reply_endpoint(), wire::kAmReply,
                    absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(ok.data()), ok.size()),
                    nullptr, 0, [](absl::Status) {});
    });
    if (absl::Status s = worker_->Start(); !s.ok()) Fail(s.ToString());
  }

  const std::string& address() const { return worker_->address(); }
  void Connect(const std::string& shard) {
    auto ep = worker_->Connect(shard);
    if (!ep.ok()) Fail(ep.status().ToString());
    ep_ = *ep;
  }
  // The payload is copied and lives until the send completes.
  void Send(uint16_t am, const std::string& header, std::string payload) {
    auto keep = std::make_shared<std::string>(std::move(payload));
    worker_->Send(ep_, am,
                  absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(header.data()),
                                            header.size()),
                  keep->empty() ? nullptr : keep->data(), keep->size(),
                  [keep](absl::Status) {});
  }
  // Whether request `request_id` was answered within `wait`.
  bool AwaitAnswer(uint64_t request_id, absl::Duration wait) {
    bool first = false;
    return AwaitEither(request_id, request_id, wait, &first);
  }
  // Waits until request `a` or `b` is answered (false: neither within
  // `wait`); *got_a says whether `a` was.
  bool AwaitEither(uint64_t a, uint64_t b, absl::Duration wait, bool* got_a) {
    absl::MutexLock lock(&mu_);
    auto there = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return answered_.count(a) != 0 || answered_.count(b) != 0;
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&there), wait)) return false;
    *got_a = answered_.count(a) != 0;
    return true;
  }
  void ForgetAnswers() {
    absl::MutexLock lock(&mu_);
    answered_.clear();
  }

 private:
  // OPTIMUS_FUZZ_VERBOSE=1: print every answer (to check a new corpus entry).
  const bool verbose_ = std::getenv("OPTIMUS_FUZZ_VERBOSE") != nullptr;
  std::unique_ptr<transport::Worker> worker_;
  transport::EndpointRef ep_;
  absl::Mutex mu_;
  std::set<uint64_t> answered_ ABSL_GUARDED_BY(mu_);
};

server::JobDescription MakeJob(JobVariant v, uint64_t job_id, uint64_t me) {
  server::JobDescription d;
  server::JobConfig& c = d.config;
  c.job_id = job_id;
  c.name = absl::StrCat("fuzz-", job_id);
  d.map.epoch = 1;
  auto chunk = [&](uint32_t tensor, uint32_t index, uint64_t offset, uint64_t n, uint64_t primary,
                   uint64_t backup) {
    server::ChunkPlacement p;
    p.tensor = tensor;
    p.chunk = index;
    p.offset_elems = offset;
    p.num_elems = n;
    p.primary = primary;
    p.backup = backup;
    d.map.chunks.push_back(p);
  };
  switch (v) {
    case kFp32AdamWReplicated:
    default:
      c.world_size = 2;
      c.replication = 1;
      c.grad_dtype = c.param_dtype = DType::kFp32;
      c.hyper.kind = kernels::OptimizerKind::kAdamW;
      c.hyper.lr = 1e-2f;
      chunk(0, 0, 0, 64, me, 0);
      chunk(1, 0, 0, 32, me, kPeerShardId);
      chunk(1, 1, 32, 32, kPeerShardId, me);
      break;
    case kBf16SgdClipped:
      c.world_size = 3;
      c.grad_dtype = c.param_dtype = DType::kBf16;
      c.hyper.kind = kernels::OptimizerKind::kSgd;
      c.hyper.lr = 0.1f;
      c.hyper.momentum = 0.9f;
      c.commit_round = true;
      chunk(0, 0, 0, 64, me, 0);
      chunk(1, 0, 0, 16, me, 0);
      break;
    case kFp16LionCheckpointed:
      c.world_size = 1;
      c.grad_dtype = c.param_dtype = DType::kFp16;
      c.hyper.kind = kernels::OptimizerKind::kLion;
      c.hyper.lr = 1e-4f;
      c.checkpoint_every_steps = 2;
      chunk(0, 0, 0, 48, me, 0);
      chunk(0, 1, 48, 16, me, 0);
      break;
  }
  if (!kernels::FillDefaultsAndValidate(&c.hyper).ok()) Fail("bad job hyperparameters");
  c.grad_scale = 1.0f / static_cast<float>(c.world_size);
  uint32_t tensors = 0;
  for (const server::ChunkPlacement& p : d.map.chunks) tensors = std::max(tensors, p.tensor + 1);
  for (uint32_t t = 0; t < tensors; ++t) {
    server::JobConfig::Tensor tc;
    tc.hyper = c.hyper;
    tc.frozen = v == kBf16SgdClipped && t == 1;
    c.tensors.push_back(tc);
  }
  return d;
}

struct Harness {
  std::string ckpt_dir;
  std::shared_ptr<transport::LoopbackFabric> fabric;
  FakeLink* link = nullptr;  // Owned by the shard.
  std::unique_ptr<server::ShardServer> shard;
  std::unique_ptr<Peer> peer;
  uint64_t baseline_bytes = 0;  // Memory the shard uses with no job.
  uint64_t next_job = 1000;
  uint64_t next_sentinel = 1;

  Harness() {
    SetMinLogLevel(LogLevel::kError);
    const char* base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : std::getenv("TMPDIR");
    std::string tmpl = absl::StrCat(base != nullptr ? base : "/tmp", "/shard_fuzz.XXXXXX");
    if (mkdtemp(&tmpl[0]) == nullptr) Fail("mkdtemp");
    ckpt_dir = tmpl;
    // Payloads over 128 bytes go by rendezvous: both paths are exercised.
    transport::LoopbackOptions lo;
    lo.rendezvous_threshold_bytes = 128;
    fabric = transport::LoopbackFabric::Create(lo);
    auto link_owned = std::make_unique<FakeLink>();
    link = link_owned.get();
    server::ShardServerOptions o;
    o.coordinator_address = "fake";
    o.memory_limit_bytes = 64 << 20;
    o.step_threads = 2;
    o.kernel_threads = 1;
    o.heartbeat_interval = absl::Milliseconds(1);
    o.transport.loopback = fabric;
    o.transport.name = "fuzz-shard";
    o.checkpoint_dir = ckpt_dir;
    auto s = server::ShardServer::StartWithLink(o, std::move(link_owned));
    if (!s.ok()) Fail(s.status().ToString());
    shard = *std::move(s);
    peer = std::make_unique<Peer>(fabric);
    peer->Connect(shard->data_address());
    baseline_bytes = shard->stats().memory_used_bytes;
  }
  ~Harness() {
    shard.reset();
    peer.reset();
    (void)ckpt::RemoveTree(ckpt_dir);
  }

  void Run(const uint8_t* data, size_t size) {
    if (size < 1) return;
    const auto variant = static_cast<JobVariant>(data[0] % kNumVariants);
    const uint64_t job_id = next_job++;
    server::JobDescription d = MakeJob(variant, job_id, link->shard_id());
    d.map.addresses[link->shard_id()] = shard->data_address();
    d.map.addresses[kPeerShardId] = peer->address();
    link->SetJob(d);
    if (!link->AwaitJob(job_id, true)) Fail("the shard did not load the job");

    peer->ForgetAnswers();
    size_t at = 1;
    for (int n = 0; n < kMaxRecords && at + 2 <= size; ++n) {
      const uint8_t ctl = data[at];
      const size_t hlen = std::min<size_t>(data[at + 1], size - at - 2);
      std::string header(reinterpret_cast<const char*>(data + at + 2), hlen);
      at += 2 + hlen;
      size_t plen = 0;
      if (at + 2 <= size) {
        plen = std::min<size_t>(data[at] | (size_t{data[at + 1]} << 8), size - at - 2);
        at += 2;
      } else {
        at = size;
      }
      std::string payload(reinterpret_cast<const char*>(data + at), plen);
      at += plen;
      const bool reply = (ctl & kToReplyHandler) != 0;
      if (!reply && header.size() >= sizeof(wire::RequestHeader)) {
        wire::RequestHeader h;
        std::memcpy(&h, header.data(), sizeof(h));
        if (ctl & kFixHeader) Fix(&h, job_id);
        if (ctl & kFixBytes) h.num_bytes = payload.size();
        std::memcpy(&header[0], &h, sizeof(h));
        if ((ctl & kFixBatch) && h.op == static_cast<uint16_t>(wire::Op::kBatch)) {
          for (size_t i = 0; i < h.step && (i + 1) * sizeof(h) <= payload.size(); ++i) {
            wire::RequestHeader item;
            std::memcpy(&item, &payload[i * sizeof(h)], sizeof(h));
            Fix(&item, job_id);
            std::memcpy(&payload[i * sizeof(h)], &item, sizeof(h));
          }
        }
      } else if (reply && header.size() >= sizeof(wire::ReplyHeader)) {
        wire::ReplyHeader h;
        std::memcpy(&h, header.data(), sizeof(h));
        if (ctl & kFixHeader) {
          h.magic = wire::kMagic;
          h.version = wire::kVersion;
        }
        if (ctl & kFixBytes) h.message_len = static_cast<uint32_t>(header.size() - sizeof(h));
        std::memcpy(&header[0], &h, sizeof(h));
      }
      peer->Send(reply ? wire::kAmReply : wire::kAmRequest, header, std::move(payload));
      if ((ctl & kAwaitReply) && !reply && header.size() >= sizeof(wire::RequestHeader)) {
        wire::RequestHeader h;
        std::memcpy(&h, header.data(), sizeof(h));
        Settle(h.request_id);
      }
    }

    // Still answering.
    const uint64_t last = SendSentinel();
    if (!peer->AwaitAnswer(last, kAnswerWait)) Fail("the shard stopped answering requests");

    link->Release(job_id);
    if (!link->AwaitJob(job_id, false)) Fail("the shard did not release the job");
    // Everything the job cost comes back once what was in flight is done
    // (the staging pool keeps its buffers for reuse, within its limit).
    const absl::Time give_up = absl::Now() + kAnswerWait;
    for (;;) {
      const server::ShardServerStats st = shard->stats();
      if (st.staging_in_use_bytes == 0 && st.jobs == 0 &&
          st.memory_used_bytes <= baseline_bytes + st.staging_limit_bytes) {
        break;
      }
      if (absl::Now() > give_up) {
        Fail(absl::StrCat("a released job's memory was not given back: ", st.memory_used_bytes,
                          " bytes used (", baseline_bytes, " with no job, staging limit ",
                          st.staging_limit_bytes, "), ", st.staging_in_use_bytes,
                          " bytes of staging in use, ", st.jobs, " jobs"));
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
  }

  // A pull for a job nobody has: refused at once, on the progress thread,
  // after everything sent before it. Returns its request id.
  uint64_t SendSentinel() {
    wire::RequestHeader sentinel;
    sentinel.op = static_cast<uint16_t>(wire::Op::kPull);
    sentinel.dtype = static_cast<uint8_t>(DType::kFp32);
    sentinel.job_id = 0;
    sentinel.request_id = (uint64_t{0xfeed} << 48) | next_sentinel++;
    peer->Send(wire::kAmRequest, HeaderBytes(sentinel), "");
    return sentinel.request_id;
  }

  // Until request `id` is answered, or two sentinels in a row are: the
  // first is handled after the request, the second after what the
  // request's handler queued on the progress thread (a rendezvous copy and
  // what runs when it lands).
  void Settle(uint64_t id) {
    for (int round = 0; round < 2; ++round) {
      const uint64_t s = SendSentinel();
      bool got_id = false;
      if (!peer->AwaitEither(id, s, kAnswerWait, &got_id)) {
        Fail("the shard stopped answering requests");
      }
      if (got_id) return;
    }
  }

  static void Fix(wire::RequestHeader* h, uint64_t job_id) {
    h->magic = wire::kMagic;
    h->version = wire::kVersion;
    h->job_id = job_id;
    h->map_epoch = 1;
  }
};

Harness* TheHarness() {
  static Harness* h = [] {
    auto* made = new Harness;
    // Stop the shard's threads before the process's statics go.
    std::atexit([] { delete TheHarness(); });
    return made;
  }();
  return h;
}

}  // namespace
}  // namespace fuzz
}  // namespace optimus

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  optimus::fuzz::TheHarness()->Run(data, size);
  return 0;
}
