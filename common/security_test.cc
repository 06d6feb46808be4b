#include "common/security.h"

#include <cstdlib>
#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace optimus {
namespace security {
namespace {

TEST(SecurityTest, RolesComeFromTheCommonNamePrefix) {
  EXPECT_EQ(RoleOfCommonName("admin:alice"), Role::kAdmin);
  EXPECT_EQ(RoleOfCommonName("admin"), Role::kAdmin);
  EXPECT_EQ(RoleOfCommonName("shard:dpu-17"), Role::kShard);
  EXPECT_EQ(RoleOfCommonName("trainer:team-a"), Role::kTrainer);
  EXPECT_EQ(RoleOfCommonName("shard"), Role::kNone);  // A shard needs a name.
  EXPECT_EQ(RoleOfCommonName("administrator:x"), Role::kNone);
  EXPECT_EQ(RoleOfCommonName("optimus-coordinator"), Role::kNone);
  EXPECT_EQ(RoleOfCommonName(""), Role::kNone);
}

TEST(SecurityTest, TokensAreRandomAndCheckedForStrength) {
  auto a = NewToken();
  auto b = NewToken();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->size(), 64u);
  EXPECT_NE(*a, *b);
  EXPECT_TRUE(CheckToken(*a).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(CheckToken("too-short")));
  EXPECT_TRUE(absl::IsInvalidArgument(CheckToken(std::string(300, 'a'))));
  EXPECT_TRUE(absl::IsInvalidArgument(CheckToken(std::string(40, 'a') + "\n")));
  EXPECT_TRUE(TokensEqual(*a, *a));
  EXPECT_FALSE(TokensEqual(*a, *b));
  EXPECT_FALSE(TokensEqual(*a, a->substr(1)));
}

TEST(SecurityTest, HmacSha256MatchesRfc4231) {
  // RFC 4231, test case 2.
  EXPECT_EQ(absl::BytesToHexString(HmacSha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

class TlsLoadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv(kTlsDirEnv);
    unsetenv(kPlaintextEnv);
  }
};

TEST_F(TlsLoadTest, NothingChosenIsAnErrorThatSaysHow) {
  auto m = LoadTls(TlsOptions(), false, "test");
  ASSERT_FALSE(m.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(m.status()));
  EXPECT_NE(m.status().message().find("--insecure_plaintext"), std::string::npos);
  EXPECT_NE(m.status().message().find("make_local_ca.sh"), std::string::npos);
}

TEST_F(TlsLoadTest, PlaintextOnlyWhenAskedFor) {
  TlsOptions o;
  o.plaintext = true;
  auto m = LoadTls(o, true, "test");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->plaintext);
  setenv(kPlaintextEnv, "1", 1);
  m = LoadTls(TlsOptions(), true, "test");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->plaintext);
  o.dir = "/somewhere";
  EXPECT_TRUE(absl::IsInvalidArgument(LoadTls(o, true, "test").status()));
}

TEST_F(TlsLoadTest, ReadsAFolderAndRequiresACertWhereNeeded) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/ca-unit");
  const char* runfiles = std::getenv("TEST_SRCDIR");
  const std::string cmd = absl::StrCat(runfiles != nullptr ? runfiles : ".",
                                       "/optimus/scripts/make_local_ca.sh ", dir,
                                       " --shards 1 >/dev/null");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  TlsOptions o;
  o.dir = dir + "/shard-0";
  auto m = LoadTls(o, true, "test");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->plaintext);
  EXPECT_NE(m->cert_pem.find("BEGIN CERTIFICATE"), std::string::npos);
  // A worker's folder has the CA only: fine for a client, not for a server.
  o.dir = dir + "/worker";
  EXPECT_TRUE(LoadTls(o, false, "test").ok());
  EXPECT_TRUE(absl::IsNotFound(LoadTls(o, true, "test").status()));
  // The environment's folder wins over its plaintext switch.
  setenv(kTlsDirEnv, (dir + "/admin").c_str(), 1);
  setenv(kPlaintextEnv, "1", 1);
  m = LoadTls(TlsOptions(), true, "test");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->plaintext);
  o.dir = dir + "/missing";
  EXPECT_TRUE(absl::IsNotFound(LoadTls(o, false, "test").status()));
}

// Several coordinators (a leader and its standbys) share one certificate
// that names every host clients dial them by.
TEST(MakeLocalCaTest, ACoordinatorListNamesEveryHost) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/ca-coordinators");
  const char* runfiles = std::getenv("TEST_SRCDIR");
  const std::string script =
      absl::StrCat(runfiles != nullptr ? runfiles : ".", "/optimus/scripts/make_local_ca.sh ");
  const std::string cmd = absl::StrCat(
      script, dir, " --shards 1 --coordinators 'coord-a.ml.svc:7070, 10.1.2.3:7071,[::2]:7072,localhost:7073' >/dev/null");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  FILE* p = popen(absl::StrCat("openssl x509 -noout -text -in ", dir, "/coordinator/tls.crt").c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) text.append(buf, n);
  ASSERT_EQ(pclose(p), 0);
  for (const char* want : {"DNS:coord-a.ml.svc", "IP Address:10.1.2.3", "IP Address:0:0:0:0:0:0:0:2",
                           "DNS:localhost", "IP Address:127.0.0.1"}) {
    EXPECT_NE(text.find(want), std::string::npos) << want << " not in\n" << text;
  }
  // localhost is named once, not twice.
  EXPECT_EQ(text.find("DNS:localhost"), text.rfind("DNS:localhost"));
  // An entry without a port is refused, making nothing.
  const std::string bad = absl::StrCat(script, dir, "-bad --coordinators coord-a 2>/dev/null");
  EXPECT_NE(std::system(bad.c_str()), 0);
  EXPECT_NE(std::system(absl::StrCat("test -e ", dir, "-bad/coordinator/tls.crt").c_str()), 0);
}

}  // namespace
}  // namespace security
}  // namespace optimus
