// A transport worker in a process of its own, driven over stdin/stdout by
// transport tests that need a peer they can SIGKILL or that must run in
// another process (shared memory between processes). Test-only.
//
// Flags: --transports, --net_devices, --detect_peer_failure (WorkerOptions;
// default empty, i.e. UCX's defaults, and true), --keep (the data handler keeps every payload and never
// receives it, instead of receiving it).
// Prints "ADDRESS <hex>" once started, then answers commands, one a line:
//   CONNECT <hex>   connect to that address; prints "CONNECTED <status>"
//   SEND <bytes>    send a payload of that many bytes (test_util::Pattern,
//                   seed 5) as message 1 on the connected endpoint; prints
//                   "SENT" at once and "SENDDONE <status>" when it completes
//   TRANSPORTS      prints "TRANSPORTS <transports_in_use()>"
//   EXIT            exits
// and reports "KEPT <bytes>" or "GOT <bytes> <status>" for each message 1
// received. Message 2 is answered with a copy of its payload (message 3).
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "transport/test_util.h"
#include "transport/transport.h"

ABSL_FLAG(std::string, transports, "", "WorkerOptions::transports");
ABSL_FLAG(std::string, net_devices, "", "WorkerOptions::net_devices");
ABSL_FLAG(bool, keep, false, "keep payloads of message 1 instead of receiving them");
ABSL_FLAG(bool, detect_peer_failure, true, "WorkerOptions::detect_peer_failure");

namespace optimus {
namespace transport {
namespace {

absl::Mutex out_mu;

void Say(const std::string& line) {
  absl::MutexLock lock(&out_mu);
  std::fprintf(stdout, "%s\n", line.c_str());
  std::fflush(stdout);
}

int Main() {
  WorkerOptions o;
  o.name = "test_peer";
  o.transports = absl::GetFlag(FLAGS_transports);
  o.net_devices = absl::GetFlag(FLAGS_net_devices);
  o.detect_peer_failure = absl::GetFlag(FLAGS_detect_peer_failure);
  auto w = Worker::Create(o);
  if (!w.ok()) {
    Say(absl::StrCat("ERROR ", w.status().ToString()));
    return 1;
  }
  Worker* worker = w->get();
  absl::Mutex mu;
  std::vector<std::unique_ptr<PendingPayload>> kept;  // Never received.
  const bool keep = absl::GetFlag(FLAGS_keep);
  worker->SetHandler(1, [&](IncomingMessage& m) {
    if (keep) {
      std::unique_ptr<PendingPayload> p = m.Keep();
      Say(absl::StrCat("KEPT ", m.payload_size()));
      absl::MutexLock lock(&mu);
      kept.push_back(std::move(p));
      return;
    }
    auto buf = std::make_shared<std::vector<uint8_t>>(m.payload_size());
    m.ReceiveInto(buf->data(), [buf](absl::Status s) {
      Say(absl::StrCat("GOT ", buf->size(), " ", s.ok() ? "OK" : s.ToString()));
    });
  });
  worker->SetHandler(2, [worker](IncomingMessage& m) {
    auto buf = std::make_shared<std::vector<uint8_t>>(m.payload_size());
    const EndpointRef back = m.reply_endpoint();
    m.ReceiveInto(buf->data(), [worker, buf, back](absl::Status s) {
      if (!s.ok()) return;
      worker->Send(back, 3, {}, buf->data(), buf->size(), [buf](absl::Status) {});
    });
  });
  if (absl::Status s = worker->Start(); !s.ok()) {
    Say(absl::StrCat("ERROR ", s.ToString()));
    return 1;
  }
  Say(absl::StrCat("ADDRESS ", absl::BytesToHexString(worker->address())));
  EndpointRef ep;
  std::vector<std::shared_ptr<std::vector<uint8_t>>> payloads;  // Live until exit.
  std::string line;
  while (std::getline(std::cin, line)) {
    if (absl::StartsWith(line, "CONNECT ")) {
      auto r = worker->Connect(absl::HexStringToBytes(line.substr(8)));
      if (r.ok()) ep = *r;
      Say(absl::StrCat("CONNECTED ", r.ok() ? "OK" : r.status().ToString()));
    } else if (absl::StartsWith(line, "SEND ")) {
      size_t bytes = 0;
      if (!absl::SimpleAtoi(line.substr(5), &bytes)) continue;
      payloads.push_back(std::make_shared<std::vector<uint8_t>>(test_util::Pattern(bytes, 5)));
      auto payload = payloads.back();
      worker->Send(ep, 1, test_util::Bytes("from-peer"), payload->data(), payload->size(),
                   [](absl::Status s) {
                     Say(absl::StrCat("SENDDONE ", s.ok() ? "OK" : s.ToString()));
                   });
      Say("SENT");
    } else if (line == "TRANSPORTS") {
      Say(absl::StrCat("TRANSPORTS ", worker->transports_in_use()));
    } else if (line == "EXIT") {
      break;
    }
  }
  {
    absl::MutexLock lock(&mu);
    kept.clear();
  }
  w->reset();
  return 0;
}

}  // namespace
}  // namespace transport
}  // namespace optimus

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return optimus::transport::Main();
}
