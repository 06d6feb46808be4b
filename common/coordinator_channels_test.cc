#include "common/coordinator_channels.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/generic/async_generic_service.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

extern char** environ;

namespace optimus {
namespace {

using ::testing::HasSubstr;

std::vector<std::string> Parsed(const std::string& value) {
  absl::StatusOr<std::vector<std::string>> r = ParseCoordinatorAddresses(value);
  EXPECT_TRUE(r.ok()) << value << ": " << r.status();
  return r.ok() ? *r : std::vector<std::string>{};
}

std::string ErrorOf(const std::string& value) {
  absl::StatusOr<std::vector<std::string>> r = ParseCoordinatorAddresses(value);
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << value << " gave " << r.status();
  return std::string(r.status().message());
}

TEST(ParseCoordinatorAddressesTest, OneAddressIsItself) {
  EXPECT_EQ(Parsed("127.0.0.1:7070"), std::vector<std::string>{"127.0.0.1:7070"});
  EXPECT_EQ(Parsed("optimus-coordinator.ml.svc:7070"),
            std::vector<std::string>{"optimus-coordinator.ml.svc:7070"});
  EXPECT_EQ(Parsed("[::1]:7070"), std::vector<std::string>{"[::1]:7070"});
  EXPECT_EQ(Parsed(" localhost:1 "), std::vector<std::string>{"localhost:1"});
}

TEST(ParseCoordinatorAddressesTest, ListsSplitOnCommasAndTrimSpaces) {
  EXPECT_EQ(Parsed("a:7070,b:7071"), (std::vector<std::string>{"a:7070", "b:7071"}));
  EXPECT_EQ(Parsed("10.0.0.1:7070, 10.0.0.2:7070 ,[fe80::1]:65535"),
            (std::vector<std::string>{"10.0.0.1:7070", "10.0.0.2:7070", "[fe80::1]:65535"}));
}

TEST(ParseCoordinatorAddressesTest, GrpcTargetsPassAsTheyAre) {
  // gRPC's own lists (pick_first over IP literals) are one target.
  EXPECT_EQ(Parsed("ipv4:127.0.0.1:7070,127.0.0.1:7071"),
            std::vector<std::string>{"ipv4:127.0.0.1:7070,127.0.0.1:7071"});
  EXPECT_EQ(Parsed("dns:///coord-0:7070,dns:///coord-1:7070"),
            (std::vector<std::string>{"dns:///coord-0:7070", "dns:///coord-1:7070"}));
  EXPECT_EQ(Parsed("unix:/run/optimus.sock"), std::vector<std::string>{"unix:/run/optimus.sock"});
}

TEST(ParseCoordinatorAddressesTest, BadListsAreClearErrors) {
  EXPECT_THAT(ErrorOf(""), HasSubstr("no coordinator address"));
  EXPECT_THAT(ErrorOf("  "), HasSubstr("no coordinator address"));
  EXPECT_THAT(ErrorOf("a:1,,b:2"), HasSubstr("entry 2 is empty"));
  EXPECT_THAT(ErrorOf("a:1,"), HasSubstr("entry 2 is empty"));
  EXPECT_THAT(ErrorOf("coordinator"), HasSubstr("no port"));
  EXPECT_THAT(ErrorOf("a:1,b"), HasSubstr("\"b\" (in \"a:1,b\"): no port"));
  EXPECT_THAT(ErrorOf("a:0"), HasSubstr("not a number from 1 to 65535"));
  EXPECT_THAT(ErrorOf("a:65536"), HasSubstr("not a number from 1 to 65535"));
  EXPECT_THAT(ErrorOf("a:+80"), HasSubstr("not a number from 1 to 65535"));
  EXPECT_THAT(ErrorOf("a:http"), HasSubstr("not a number from 1 to 65535"));
  EXPECT_THAT(ErrorOf(":7070"), HasSubstr("no host"));
  EXPECT_THAT(ErrorOf("::1:7070"), HasSubstr("must be in brackets"));
  EXPECT_THAT(ErrorOf("[::1:7070"), HasSubstr("bracketed"));
  EXPECT_THAT(ErrorOf("[]:7070"), HasSubstr("bracketed"));
  EXPECT_THAT(ErrorOf("a b:7070"), HasSubstr("has a ' '"));
  // Only a comma separates.
  EXPECT_THAT(ErrorOf("a:1 b:2"), HasSubstr("coordinator address \"a:1 b:2\""));
  EXPECT_THAT(ErrorOf("a:1;b:2"), HasSubstr("coordinator address \"a:1;b:2\""));
  EXPECT_THAT(ErrorOf("a:7070,a:7070"), HasSubstr("listed twice"));
  EXPECT_THAT(ErrorOf("dns:"), HasSubstr("no address after the scheme"));
  EXPECT_THAT(ErrorOf("ipv4:"), HasSubstr("no address after the scheme"));
  // Every message says what is expected.
  EXPECT_THAT(ErrorOf("x"), HasSubstr("HOST:PORT,HOST:PORT"));
}

TEST(CoordinatorChannelsTest, BadListsMakeNoChannels) {
  auto c = CoordinatorChannels::Create("a:1,,b:2", grpc::InsecureChannelCredentials(),
                                       grpc::ChannelArguments());
  EXPECT_TRUE(absl::IsInvalidArgument(c.status())) << c.status();
  security::TlsOptions plain;
  plain.plaintext = true;
  auto d = CoordinatorChannels::Dial("nope", plain, "test");
  EXPECT_TRUE(absl::IsInvalidArgument(d.status())) << d.status();
}

// A gRPC server with no service of its own (every method UNIMPLEMENTED): it
// accepts connections, which is all a standby does not do. gRPC refuses to
// start a server with no service at all ("At least one of the completion
// queues must be frequently polled"), hence the generic callback service.
class Listener {
 public:
  // On `port` (0: any free one).
  explicit Listener(int port = 0) {
    grpc::ServerBuilder b;
    b.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::InsecureServerCredentials(),
                       &port_);
    b.RegisterCallbackGenericService(&generic_);
    server_ = b.BuildAndStart();
    EXPECT_NE(server_, nullptr) << "cannot listen on 127.0.0.1:" << port;
  }
  ~Listener() { Stop(); }
  void Stop() {
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
    server_.reset();
  }
  int port() const { return port_; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  int port_ = 0;
  grpc::CallbackGenericService generic_;
  std::unique_ptr<grpc::Server> server_;
};

// A port nothing listens on (one a listener had).
int DeadPort() {
  Listener l;
  return l.port();
}

std::shared_ptr<CoordinatorChannels> Channels(const std::string& addresses) {
  auto c = CoordinatorChannels::Create(addresses, grpc::InsecureChannelCredentials(),
                                       grpc::ChannelArguments());
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : nullptr;
}

const absl::Duration kHangGuard = absl::Seconds(30);

TEST(CoordinatorChannelsTest, OneAddressNeverMoves) {
  auto c = Channels(absl::StrCat("127.0.0.1:", DeadPort()));
  ASSERT_EQ(c->size(), 1u);
  c->Report(0, grpc::Status(grpc::StatusCode::UNAVAILABLE, "down"));
  EXPECT_EQ(c->current(), 0u);
}

TEST(CoordinatorChannelsTest, UnreachableMovesOnAndAnswersAreFollowed) {
  const int a = DeadPort(), b = DeadPort();
  auto c = Channels(absl::StrCat("127.0.0.1:", a, ",127.0.0.1:", b));
  ASSERT_EQ(c->size(), 2u);
  EXPECT_EQ(c->addresses(), absl::StrCat("127.0.0.1:", a, ",127.0.0.1:", b));
  EXPECT_EQ(c->current(), 0u);
  // The coordinator's own errors say it is there: stay.
  c->Report(0, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "bad request"));
  c->Report(0, grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "no"));
  EXPECT_EQ(c->current(), 0u);
  // Nothing listens: the next address.
  c->Report(0, grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection refused"));
  EXPECT_EQ(c->current(), 1u);
  // A late failure of a call that went to the old one changes nothing.
  c->Report(0, grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection refused"));
  EXPECT_EQ(c->current(), 1u);
  // Round and round while no one listens (the election gap)...
  c->Report(1, grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection refused"));
  EXPECT_EQ(c->current(), 0u);
  // ...and a call that was answered names the leader.
  c->Report(1, grpc::Status::OK);
  EXPECT_EQ(c->current(), 1u);
}

TEST(CoordinatorChannelsTest, MovesToTheAddressThatListens) {
  const int dead = DeadPort();
  Listener leader;
  // The listener is second: a failed call on the first finds it connected
  // once it has been asked to connect.
  auto c = Channels(absl::StrCat("127.0.0.1:", dead, ",", leader.address()));
  ASSERT_TRUE(c->WaitForConnected(absl::Now() + kHangGuard));
  EXPECT_EQ(c->current(), 1u);
  // The leader dies and the standby at the first address takes over.
  leader.Stop();
  Listener standby(dead);
  ASSERT_EQ(standby.port(), dead) << "the test could not listen on its port again";
  // Calls fail on the old leader until one finds the new one connected.
  const absl::Time give_up = absl::Now() + kHangGuard;
  while (c->current() != 0 && absl::Now() < give_up) {
    c->Report(1, grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection reset"));
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(c->current(), 0u);
  EXPECT_TRUE(c->channel(0)->WaitForConnected(absl::ToChronoTime(absl::Now() + kHangGuard)));
}

TEST(CoordinatorChannelsTest, SlowAnswersFromAConnectedLeaderDoNotMove) {
  Listener leader;
  const int dead = DeadPort();
  auto c = Channels(absl::StrCat(leader.address(), ",127.0.0.1:", dead));
  ASSERT_TRUE(c->WaitForConnected(absl::Now() + kHangGuard));
  ASSERT_EQ(c->current(), 0u);
  c->Report(0, grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "slow"));
  EXPECT_EQ(c->current(), 0u);
}

// common/grpc_listener_for_test listening on `port` in a process of its
// own (see there why), until destroyed.
class ListenerProcess {
 public:
  explicit ListenerProcess(int port) {
    const char* srcdir = std::getenv("TEST_SRCDIR");
    if (srcdir == nullptr) return;
    binary_ = absl::StrCat(srcdir, "/optimus/common/grpc_listener_for_test");
    if (access(binary_.c_str(), X_OK) != 0) return;
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) return;
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    posix_spawn_file_actions_addclose(&actions, in[1]);
    posix_spawn_file_actions_addclose(&actions, out[0]);
    std::string port_arg = absl::StrCat(port);
    char* argv[] = {binary_.data(), port_arg.data(), nullptr};
    const int rc = posix_spawn(&pid_, binary_.c_str(), &actions, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    close(in[0]);
    close(out[1]);
    to_child_ = in[1];
    if (rc != 0) {
      pid_ = -1;
      close(out[0]);
      return;
    }
    // It prints "listening" once it does (or exits: EOF).
    std::string said;
    char ch;
    while (said.find('\n') == std::string::npos && read(out[0], &ch, 1) == 1) said += ch;
    close(out[0]);
    listening_ = said == "listening\n";
  }
  ~ListenerProcess() {
    if (to_child_ >= 0) close(to_child_);
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }
  bool built() const { return !binary_.empty() && access(binary_.c_str(), X_OK) == 0; }
  bool listening() const { return listening_; }

 private:
  std::string binary_;
  pid_t pid_ = -1;
  int to_child_ = -1;
  bool listening_ = false;
};

// The failure mode of shards started with the coordinators: every address
// was tried before anything listened, and from then on calls failed at once
// on channels in TRANSIENT_FAILURE and only bounced between the addresses.
// A standby elected later must become connected with no call made on it,
// so that the next failed call finds it. The coordinator runs in another
// process and the test's BUILD rule switches gRPC's backup poller off:
// either would connect the channel without the library's own thread (the
// poller 5 to 10 s later), hiding that it is missing.
TEST(CoordinatorChannelsTest, AnAddressThatStartsListeningLaterGetsConnectedWithoutCalls) {
  const int first = DeadPort(), second = DeadPort();
  auto c = Channels(absl::StrCat("127.0.0.1:", first, ",127.0.0.1:", second));
  // Both tried, neither listens.
  EXPECT_FALSE(c->WaitForConnected(absl::Now() + absl::Milliseconds(300)));
  c->Report(0, grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection refused"));
  c->Report(1, grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection refused"));
  ListenerProcess elected(second);
  if (!elected.built()) GTEST_SKIP() << "common/grpc_listener_for_test is not built here";
  ASSERT_TRUE(elected.listening()) << "the test could not listen on its port again";
  // Nobody calls, nobody watches: only the channels' own thread can connect it.
  const absl::Time give_up = absl::Now() + kHangGuard;
  while (c->channel(1)->GetState(/*try_to_connect=*/false) != GRPC_CHANNEL_READY &&
         absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(c->channel(1)->GetState(false), GRPC_CHANNEL_READY)
      << "a coordinator listening at the second address was never connected to";
  // The next failed call on the dead one moves straight to it.
  c->Report(c->current(), grpc::Status(grpc::StatusCode::UNAVAILABLE, "connection refused"));
  EXPECT_EQ(c->current(), 1u);
}

TEST(CoordinatorChannelsTest, WaitForConnectedGivesUpWhenNoOneListens) {
  auto c = Channels(absl::StrCat("127.0.0.1:", DeadPort(), ",127.0.0.1:", DeadPort()));
  EXPECT_FALSE(c->WaitForConnected(absl::Now() + absl::Milliseconds(300)));
  EXPECT_EQ(c->current(), 0u);
}

}  // namespace
}  // namespace optimus
