// Data-plane workers that tests hand to a Client (ClientOptions::make_worker)
// to see what it asks of its transport:
//   ForwardingWorker / ForwardingMessage  pass every call through; the
//                    base of a test's own wrapper;
//   CountingWorker   wraps a real worker and records every registration and
//                    which registration each payload send and receive used;
//   FakeShardWorker  is every shard at once: answers each request inside
//                    Send, on the caller's thread, allocating nothing, so a
//                    test can count the client's own allocations.
// Thread-safety: CountingWorker's log is safe from any thread; a
// FakeShardWorker serves one client.
#ifndef OPTIMUS_TESTS_INTEGRATION_CLIENT_TEST_WORKERS_H_
#define OPTIMUS_TESTS_INTEGRATION_CLIENT_TEST_WORKERS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/wire.h"
#include "transport/transport.h"

namespace optimus {
namespace testing_workers {

// What a CountingWorker saw.
class TransportLog {
 public:
  struct Transfer {
    uintptr_t begin = 0;
    size_t bytes = 0;
    uintptr_t region_begin = 0;  // 0: sent or received without a region.
    size_t region_bytes = 0;
  };

  void Registered(uintptr_t begin, size_t bytes) {
    absl::MutexLock lock(&mu_);
    registrations_.push_back({begin, bytes});
  }
  void Sent(const Transfer& t) {
    absl::MutexLock lock(&mu_);
    sends_.push_back(t);
  }
  void Received(const Transfer& t) {
    absl::MutexLock lock(&mu_);
    receives_.push_back(t);
  }
  // (begin, bytes) of every RegisterMemory call, in order.
  std::vector<std::pair<uintptr_t, size_t>> registrations() const {
    absl::MutexLock lock(&mu_);
    return registrations_;
  }
  // Payload sends and receives (payload size > 0).
  std::vector<Transfer> sends() const {
    absl::MutexLock lock(&mu_);
    return sends_;
  }
  std::vector<Transfer> receives() const {
    absl::MutexLock lock(&mu_);
    return receives_;
  }
  void Clear() {
    absl::MutexLock lock(&mu_);
    sends_.clear();
    receives_.clear();
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::pair<uintptr_t, size_t>> registrations_ ABSL_GUARDED_BY(mu_);
  std::vector<Transfer> sends_ ABSL_GUARDED_BY(mu_);
  std::vector<Transfer> receives_ ABSL_GUARDED_BY(mu_);
};

// A registration of the wrapped worker, with the range it covers.
class CountedRegion : public transport::MemoryRegion {
 public:
  CountedRegion(std::unique_ptr<transport::MemoryRegion> inner, uintptr_t begin, size_t bytes)
      : inner_(std::move(inner)), begin_(begin), bytes_(bytes) {}
  const transport::MemoryRegion* inner() const { return inner_.get(); }
  uintptr_t begin() const { return begin_; }
  size_t bytes() const { return bytes_; }

 private:
  std::unique_ptr<transport::MemoryRegion> inner_;
  uintptr_t begin_;
  size_t bytes_;
};

inline TransportLog::Transfer TransferOf(const void* data, size_t bytes,
                                         const transport::MemoryRegion* region) {
  TransportLog::Transfer t;
  t.begin = reinterpret_cast<uintptr_t>(data);
  t.bytes = bytes;
  if (const auto* r = static_cast<const CountedRegion*>(region)) {
    t.region_begin = r->begin();
    t.region_bytes = r->bytes();
  }
  return t;
}

inline const transport::MemoryRegion* Inner(const transport::MemoryRegion* region) {
  return region == nullptr ? nullptr : static_cast<const CountedRegion*>(region)->inner();
}

// Pass every call to the wrapped message or worker; a test's wrapper
// derives from these and overrides only what it watches or changes.
class ForwardingMessage : public transport::IncomingMessage {
 public:
  explicit ForwardingMessage(transport::IncomingMessage& inner) : inner_(inner) {}
  uint16_t am_id() const override { return inner_.am_id(); }
  absl::Span<const uint8_t> header() const override { return inner_.header(); }
  size_t payload_size() const override { return inner_.payload_size(); }
  bool is_rendezvous() const override { return inner_.is_rendezvous(); }
  transport::EndpointRef reply_endpoint() const override { return inner_.reply_endpoint(); }
  const std::string& peer_identity() const override { return inner_.peer_identity(); }
  // A receive without a region goes through the one with a region (null),
  // as ForwardingWorker's sends do.
  void ReceiveInto(void* dst, transport::DoneCallback done) override {
    ReceiveInto(dst, nullptr, std::move(done));
  }
  void ReceiveInto(void* dst, const transport::MemoryRegion* region,
                   transport::DoneCallback done) override {
    inner_.ReceiveInto(dst, region, std::move(done));
  }
  std::unique_ptr<transport::PendingPayload> Keep() override { return inner_.Keep(); }

 protected:
  transport::IncomingMessage& inner_;
};

// A handler that hands `handler` each message wrapped as M(message, arg):
// how a test's worker watches what arrives.
template <typename M, typename Arg>
transport::Handler WrapMessages(transport::Handler handler, Arg arg) {
  return [handler = std::move(handler), arg](transport::IncomingMessage& m) {
    M wrapped(m, arg);
    handler(wrapped);
  };
}

class ForwardingWorker : public transport::Worker {
 public:
  explicit ForwardingWorker(std::unique_ptr<transport::Worker> inner) : inner_(std::move(inner)) {}
  const std::string& address() const override { return inner_->address(); }
  void SetHandler(uint16_t am_id, transport::Handler handler) override {
    inner_->SetHandler(am_id, std::move(handler));
  }
  absl::Status Start() override { return inner_->Start(); }
  using transport::Worker::Connect;
  absl::StatusOr<transport::EndpointRef> Connect(const std::string& peer,
                                                 const std::string& identity) override {
    return inner_->Connect(peer, identity);
  }
  // A send without a region goes through the one with a region (null), so
  // that a wrapper that watches sends overrides that one only.
  void Send(transport::EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
            const void* payload, size_t payload_size, transport::DoneCallback done) override {
    Send(ep, am_id, header, payload, payload_size, nullptr, std::move(done));
  }
  void Send(transport::EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
            const void* payload, size_t payload_size, const transport::MemoryRegion* region,
            transport::DoneCallback done) override {
    inner_->Send(ep, am_id, header, payload, payload_size, region, std::move(done));
  }
  std::string transports_in_use() const override { return inner_->transports_in_use(); }
  absl::StatusOr<std::unique_ptr<transport::MemoryRegion>> RegisterMemory(
      void* data, size_t size_bytes) override {
    return inner_->RegisterMemory(data, size_bytes);
  }

 protected:
  std::unique_ptr<transport::Worker> inner_;
};

// harness::ClusterOptions::make_worker for a wrapper
// W(std::unique_ptr<transport::Worker> inner, args...) around every rank's
// real worker.
template <typename W, typename... Args>
auto WrapEveryRank(Args... args) {
  return [args...](uint32_t, const transport::WorkerOptions& w)
             -> absl::StatusOr<std::unique_ptr<transport::Worker>> {
    auto inner = transport::Worker::Create(w);
    if (!inner.ok()) return inner.status();
    return std::unique_ptr<transport::Worker>(new W(*std::move(inner), args...));
  };
}

class CountingMessage : public ForwardingMessage {
 public:
  CountingMessage(transport::IncomingMessage& inner, TransportLog* log)
      : ForwardingMessage(inner), log_(log) {}
  using ForwardingMessage::ReceiveInto;
  void ReceiveInto(void* dst, const transport::MemoryRegion* region,
                   transport::DoneCallback done) override {
    if (inner_.payload_size() > 0) log_->Received(TransferOf(dst, inner_.payload_size(), region));
    inner_.ReceiveInto(dst, Inner(region), std::move(done));
  }

 private:
  TransportLog* log_;
};

class CountingWorker : public ForwardingWorker {
 public:
  CountingWorker(std::unique_ptr<transport::Worker> inner, std::shared_ptr<TransportLog> log)
      : ForwardingWorker(std::move(inner)), log_(std::move(log)) {}

  void SetHandler(uint16_t am_id, transport::Handler handler) override {
    inner_->SetHandler(am_id, WrapMessages<CountingMessage>(std::move(handler), log_.get()));
  }
  using ForwardingWorker::Send;
  void Send(transport::EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
            const void* payload, size_t payload_size, const transport::MemoryRegion* region,
            transport::DoneCallback done) override {
    if (payload_size > 0) log_->Sent(TransferOf(payload, payload_size, region));
    inner_->Send(ep, am_id, header, payload, payload_size, Inner(region), std::move(done));
  }
  absl::StatusOr<std::unique_ptr<transport::MemoryRegion>> RegisterMemory(
      void* data, size_t size_bytes) override {
    auto inner = inner_->RegisterMemory(data, size_bytes);
    if (!inner.ok()) return inner.status();
    log_->Registered(reinterpret_cast<uintptr_t>(data), size_bytes);
    return std::unique_ptr<transport::MemoryRegion>(
        new CountedRegion(std::move(*inner), reinterpret_cast<uintptr_t>(data), size_bytes));
  }

 private:
  std::shared_ptr<TransportLog> log_;
};

// Answers every request in Send, before it returns: init, push and commit
// with OK (a push also with a partial sum of squares of 1, which a job
// without the clipping round ignores), pull with `pull_fill` bytes.
class FakeShardWorker : public transport::Worker {
 public:
  explicit FakeShardWorker(size_t max_payload_bytes, uint8_t pull_fill = 0)
      : payload_(max_payload_bytes, pull_fill) {}

  const std::string& address() const override { return address_; }
  void SetHandler(uint16_t am_id, transport::Handler handler) override {
    if (am_id == wire::kAmReply) reply_handler_ = std::move(handler);
  }
  absl::Status Start() override { return absl::OkStatus(); }
  using transport::Worker::Connect;
  absl::StatusOr<transport::EndpointRef> Connect(const std::string&, const std::string&) override {
    return transport::EndpointRef{&endpoint_};
  }
  void Send(transport::EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
            const void* payload, size_t payload_size, transport::DoneCallback done) override {
    Send(ep, am_id, header, payload, payload_size, nullptr, std::move(done));
  }
  void Send(transport::EndpointRef, uint16_t, absl::Span<const uint8_t> header, const void*,
            size_t, const transport::MemoryRegion*, transport::DoneCallback done) override {
    wire::RequestHeader h;
    std::memcpy(&h, header.data(), std::min(header.size(), sizeof(h)));
    done(absl::OkStatus());
    wire::ReplyHeader r;
    r.request_id = h.request_id;
    size_t reply_payload = 0;
    if (h.op == static_cast<uint16_t>(wire::Op::kPull)) {
      r.param_version = h.step;
      reply_payload = std::min<size_t>(h.num_bytes, payload_.size());
    }
    if (h.op == static_cast<uint16_t>(wire::Op::kPush)) {
      r.flags = wire::kReplyPartial;
      r.grad_sum_squares = 1.0;
    }
    Message m(absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(&r), sizeof(r)),
              payload_.data(), reply_payload, transport::EndpointRef{&endpoint_});
    reply_handler_(m);
  }
  absl::StatusOr<std::unique_ptr<transport::MemoryRegion>> RegisterMemory(void*,
                                                                          size_t) override {
    return std::unique_ptr<transport::MemoryRegion>(new transport::MemoryRegion());
  }

 private:
  class Message : public transport::IncomingMessage {
   public:
    Message(absl::Span<const uint8_t> header, const uint8_t* payload, size_t size,
            transport::EndpointRef from)
        : header_(header), payload_(payload), size_(size), from_(from) {}
    const std::string identity_;
    uint16_t am_id() const override { return wire::kAmReply; }
    absl::Span<const uint8_t> header() const override { return header_; }
    size_t payload_size() const override { return size_; }
    bool is_rendezvous() const override { return false; }
    transport::EndpointRef reply_endpoint() const override { return from_; }
    const std::string& peer_identity() const override { return identity_; }
    void ReceiveInto(void* dst, transport::DoneCallback done) override {
      if (size_ > 0) std::memcpy(dst, payload_, size_);
      done(absl::OkStatus());
    }
    void ReceiveInto(void* dst, const transport::MemoryRegion*,
                     transport::DoneCallback done) override {
      ReceiveInto(dst, std::move(done));
    }
    std::unique_ptr<transport::PendingPayload> Keep() override { return nullptr; }

   private:
    absl::Span<const uint8_t> header_;
    const uint8_t* payload_;
    size_t size_;
    transport::EndpointRef from_;
  };

  const std::string address_ = "fake-shard";
  int endpoint_ = 0;
  std::vector<uint8_t> payload_;
  transport::Handler reply_handler_;
};

}  // namespace testing_workers
}  // namespace optimus

#endif  // OPTIMUS_TESTS_INTEGRATION_CLIENT_TEST_WORKERS_H_
