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

}  // namespace
}  // namespace security
}  // namespace optimus
