#include "common/coordinator_channels.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/grpc_limits.h"
#include "common/logging.h"

namespace optimus {
namespace {

constexpr char kLog[] = "coordinator-link";

// gRPC's URI schemes for a channel target (its resolvers). An entry that
// starts with one is a gRPC target, passed on as is.
constexpr absl::string_view kSchemes[] = {"dns",  "ipv4",          "ipv6",  "unix",
                                          "unix-abstract", "vsock", "xds", "google-c2p"};

absl::string_view SchemeOf(absl::string_view entry) {
  const size_t colon = entry.find(':');
  if (colon == absl::string_view::npos) return {};
  const absl::string_view prefix = entry.substr(0, colon);
  for (absl::string_view s : kSchemes) {
    if (prefix == s) return s;
  }
  return {};
}

absl::Status Bad(absl::string_view value, absl::string_view entry, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(
      "coordinator address \"", entry, "\"",
      entry == value ? "" : absl::StrCat(" (in \"", value, "\")"), ": ", why,
      "; give HOST:PORT, or several as HOST:PORT,HOST:PORT"));
}

// "host:port" or "[v6]:port".
absl::Status CheckHostPort(absl::string_view value, absl::string_view entry) {
  const size_t colon = entry.rfind(':');
  if (colon == absl::string_view::npos) return Bad(value, entry, "no port");
  const absl::string_view host = entry.substr(0, colon);
  const absl::string_view port = entry.substr(colon + 1);
  int p = 0;
  if (port.empty() || !absl::SimpleAtoi(port, &p) || p < 1 || p > 65535 ||
      port.find_first_not_of("0123456789") != absl::string_view::npos) {
    return Bad(value, entry, absl::StrCat("port \"", port, "\" is not a number from 1 to 65535"));
  }
  if (host.empty()) return Bad(value, entry, "no host");
  if (host.front() == '[') {
    if (host.size() < 3 || host.back() != ']' ||
        host.substr(1, host.size() - 2).find_first_of("[]") != absl::string_view::npos) {
      return Bad(value, entry, "a bracketed IPv6 host needs [ADDRESS]:PORT");
    }
    return absl::OkStatus();
  }
  if (host.find(':') != absl::string_view::npos) {
    return Bad(value, entry, "an IPv6 host must be in brackets: [ADDRESS]:PORT");
  }
  for (char c : host) {
    const bool ok = absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' ||
                    c == '_';
    if (!ok) return Bad(value, entry, absl::StrCat("the host has a '", std::string(1, c), "'"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseCoordinatorAddresses(absl::string_view value) {
  const absl::string_view trimmed = absl::StripAsciiWhitespace(value);
  if (trimmed.empty()) {
    return absl::InvalidArgumentError(
        "no coordinator address: give HOST:PORT, or several as HOST:PORT,HOST:PORT");
  }
  // gRPC's own address lists: one target.
  const absl::string_view scheme = SchemeOf(trimmed);
  if (scheme == "ipv4" || scheme == "ipv6") {
    if (trimmed.size() == scheme.size() + 1) return Bad(value, trimmed, "no address after the scheme");
    return std::vector<std::string>{std::string(trimmed)};
  }
  std::vector<std::string> out;
  int n = 0;
  for (absl::string_view raw : absl::StrSplit(trimmed, ',')) {
    ++n;
    const absl::string_view entry = absl::StripAsciiWhitespace(raw);
    if (entry.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("coordinator address list \"", value,
                                                     "\": entry ", n, " is empty"));
    }
    const absl::string_view s = SchemeOf(entry);
    if (!s.empty()) {
      if (entry.size() == s.size() + 1) return Bad(value, entry, "no address after the scheme");
    } else if (absl::Status st = CheckHostPort(value, entry); !st.ok()) {
      return st;
    }
    if (std::find(out.begin(), out.end(), entry) != out.end()) {
      return Bad(value, entry, "listed twice");
    }
    out.emplace_back(entry);
  }
  return out;
}

CoordinatorChannels::CoordinatorChannels(std::vector<std::string> addresses,
                                         std::vector<std::shared_ptr<grpc::Channel>> channels)
    : addresses_(std::move(addresses)),
      channels_(std::move(channels)),
      joined_(absl::StrJoin(addresses_, ",")) {
  if (channels_.size() > 1) connector_ = std::thread([this] { KeepConnecting(); });
}

CoordinatorChannels::~CoordinatorChannels() {
  {
    absl::MutexLock lock(&stop_mu_);
    stop_ = true;
  }
  if (connector_.joinable()) connector_.join();
}

void CoordinatorChannels::KeepConnecting() {
  // gRPC advances a connection attempt (its backoff timer, the TCP connect,
  // the TLS handshake) only while some thread polls for it: a call, a state
  // watch, or its backup poller every 5 s. A call on a channel in
  // TRANSIENT_FAILURE fails at once without polling, and Report then moves
  // on to the next address, so a caller that first tried the leader before
  // it listened (a shard started with the coordinators) found it never
  // connected: its calls only bounced between the addresses. This thread
  // waits on every channel that is not READY, so each connects as soon as
  // its backoff allows and Report finds the leader READY.
  constexpr absl::Duration kPoll = absl::Milliseconds(200);
  while (true) {
    bool all_ready = true;
    for (const std::shared_ptr<grpc::Channel>& c : channels_) {
      {
        absl::MutexLock lock(&stop_mu_);
        if (stop_) return;
      }
      const grpc_connectivity_state s = c->GetState(/*try_to_connect=*/true);
      if (s == GRPC_CHANNEL_READY) continue;
      all_ready = false;
      c->WaitForStateChange(s, absl::ToChronoTime(absl::Now() + kPoll));
    }
    if (all_ready) {
      absl::MutexLock lock(&stop_mu_);
      if (stop_mu_.AwaitWithTimeout(absl::Condition(&stop_), kPoll)) return;
    }
  }
}

absl::StatusOr<std::shared_ptr<CoordinatorChannels>> CoordinatorChannels::Create(
    absl::string_view addresses, std::shared_ptr<grpc::ChannelCredentials> credentials,
    grpc::ChannelArguments args) {
  absl::StatusOr<std::vector<std::string>> list = ParseCoordinatorAddresses(addresses);
  if (!list.ok()) return list.status();
  if (list->size() > 1) {
    // A standby refuses connections until it is elected; gRPC's default
    // backoff between attempts grows to two minutes, which would keep a
    // caller off the new leader long after the takeover. Only the pause
    // between attempts: GRPC_ARG_MIN_RECONNECT_BACKOFF_MS is also the time
    // one attempt is given (see server/coordinator_link.cc) and stays.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
                static_cast<int>(absl::ToInt64Milliseconds(kMaxBackoffWithStandbys)));
  }
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (const std::string& a : *list) {
    channels.push_back(grpc::CreateCustomChannel(a, credentials, args));
  }
  return std::shared_ptr<CoordinatorChannels>(
      new CoordinatorChannels(*std::move(list), std::move(channels)));
}

absl::StatusOr<std::shared_ptr<CoordinatorChannels>> CoordinatorChannels::Dial(
    absl::string_view addresses, const security::TlsOptions& tls_options, absl::string_view who,
    grpc::ChannelArguments args) {
  // The address first: a bad list is the clearer error.
  if (absl::StatusOr<std::vector<std::string>> list = ParseCoordinatorAddresses(addresses);
      !list.ok()) {
    return list.status();
  }
  absl::StatusOr<security::TlsMaterial> tls =
      security::LoadTls(tls_options, /*need_cert=*/false, who);
  if (!tls.ok()) return tls.status();
  args.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
  args.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
  return Create(addresses, security::ChannelCredentials(*tls), std::move(args));
}

size_t CoordinatorChannels::current() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

void CoordinatorChannels::MoveToLocked(size_t to, absl::string_view why) {
  if (to == current_) return;
  OPTIMUS_LOG(Info, kLog, "coordinator at ", addresses_[current_], " ", why,
              "; next calls go to ", addresses_[to]);
  current_ = to;
}

void CoordinatorChannels::Report(size_t used, const grpc::Status& status) {
  const size_t n = channels_.size();
  if (n == 1 || used >= n) return;
  const grpc::StatusCode code = status.error_code();
  absl::MutexLock lock(&mu_);
  if (status.ok()) {
    // It answered: it leads (a call that went out before a move came back).
    if (used != current_) {
      OPTIMUS_LOG(Info, kLog, "coordinator at ", addresses_[used], " answers; following it");
      current_ = used;
    }
    return;
  }
  // Any other error is the coordinator's answer: it is there.
  if (code != grpc::StatusCode::UNAVAILABLE && code != grpc::StatusCode::DEADLINE_EXCEEDED) return;
  if (used != current_) return;  // Another call moved on already.
  // An address already connected is the new leader (standbys do not listen).
  for (size_t k = 1; k < n; ++k) {
    const size_t j = (used + k) % n;
    if (channels_[j]->GetState(false) == GRPC_CHANNEL_READY) {
      MoveToLocked(j, "is unreachable");
      return;
    }
  }
  // None is yet: have every other address try to connect, so that the
  // next look finds the leader connected.
  for (size_t k = 1; k < n; ++k) channels_[(used + k) % n]->GetState(true);
  // A slow answer from a connected coordinator is not a reason to leave it.
  if (code == grpc::StatusCode::DEADLINE_EXCEEDED &&
      channels_[used]->GetState(false) == GRPC_CHANNEL_READY) {
    return;
  }
  MoveToLocked((used + 1) % n, "is unreachable");
}

bool CoordinatorChannels::WaitForConnected(absl::Time deadline) {
  const size_t n = channels_.size();
  size_t start;
  {
    absl::MutexLock lock(&mu_);
    start = current_;
  }
  // gRPC advances a connection attempt only while some thread polls for
  // it (a call, a state watch, or its backup poller every 5 s): GetState
  // and a sleep in between do not, and the attempts never finished within
  // optimusctl's 3 s wait. So every channel that is not READY is watched
  // on one completion queue, in short rounds (a watch cannot be cancelled:
  // once one is READY the others end within a round).
  constexpr absl::Duration kRound = absl::Milliseconds(100);
  grpc::CompletionQueue cq;
  size_t pending = 0;
  std::optional<size_t> ready;
  auto watch = [&](size_t j, grpc_connectivity_state s) {
    channels_[j]->NotifyOnStateChange(s, absl::ToChronoTime(std::min(deadline, absl::Now() + kRound)),
                                      &cq, reinterpret_cast<void*>(j));
    ++pending;
  };
  // From the current one on: with one leader, the order only matters in the
  // instant two could both be connected (an old leader on its way out).
  for (size_t k = 0; k < n && !ready.has_value(); ++k) {
    const size_t j = (start + k) % n;
    const grpc_connectivity_state s = channels_[j]->GetState(/*try_to_connect=*/true);
    if (s == GRPC_CHANNEL_READY) {
      ready = j;
    } else if (absl::Now() < deadline) {
      watch(j, s);
    }
  }
  while (pending > 0) {
    void* tag = nullptr;
    bool changed = false;
    if (!cq.Next(&tag, &changed)) break;
    --pending;
    if (ready.has_value()) continue;  // Draining the other watches.
    const size_t j = reinterpret_cast<size_t>(tag);
    const grpc_connectivity_state s = channels_[j]->GetState(/*try_to_connect=*/true);
    if (s == GRPC_CHANNEL_READY) {
      ready = j;
    } else if (absl::Now() < deadline) {
      watch(j, s);
    }
  }
  cq.Shutdown();
  void* tag = nullptr;
  bool changed = false;
  while (cq.Next(&tag, &changed)) {
  }
  if (!ready.has_value()) return false;
  absl::MutexLock lock(&mu_);
  MoveToLocked(*ready, "is not connected");
  return true;
}

}  // namespace optimus
