#include "common/security.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_limits.h"
#include "common/logging.h"

namespace optimus {
namespace security {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, bool required) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (!required) return std::string();
    return absl::NotFoundError(absl::StrCat("cannot read ", path));
  }
  std::ostringstream buf;
  buf << in.rdbuf();
  std::string pem = buf.str();
  if (pem.size() > (1 << 20)) return absl::InvalidArgumentError(absl::StrCat(path, ": over 1 MiB"));
  if (pem.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a PEM file"));
  }
  return pem;
}

bool EnvTrue(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return false;
  const absl::string_view s(v);
  return s == "1" || s == "true" || s == "yes";
}

}  // namespace

absl::StatusOr<TlsMaterial> LoadTls(const TlsOptions& options, bool need_cert,
                                    absl::string_view who) {
  if (!options.dir.empty() && options.plaintext) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": both a TLS folder and plain text asked for; pick one"));
  }
  TlsMaterial m;
  m.dir = options.dir;
  if (m.dir.empty() && !options.plaintext) {
    const char* env = std::getenv(kTlsDirEnv);
    if (env != nullptr) m.dir = env;
  }
  if (m.dir.empty()) {
    if (!options.plaintext && !EnvTrue(kPlaintextEnv)) {
      return absl::FailedPreconditionError(absl::StrCat(
          who, ": no TLS configured: give --tls_dir (or ", kTlsDirEnv,
          ") a folder with ca.crt, tls.crt and tls.key (scripts/make_local_ca.sh makes one), "
          "or ask for plain text with --insecure_plaintext (or ",
          kPlaintextEnv, "=1; no authentication: local use only)"));
    }
    m.plaintext = true;
    OPTIMUS_LOG(Warning, "security", "INSECURE: ", who,
                " uses plain-text gRPC with no authentication: anyone who can reach it "
                "can do anything. For a local cluster or tests only.");
    return m;
  }
  auto ca = ReadPem(m.dir + "/ca.crt", true);
  if (!ca.ok()) return ca.status();
  m.ca_pem = *std::move(ca);
  auto cert = ReadPem(m.dir + "/tls.crt", need_cert);
  if (!cert.ok()) return cert.status();
  m.cert_pem = *std::move(cert);
  auto key = ReadPem(m.dir + "/tls.key", need_cert || !m.cert_pem.empty());
  if (!key.ok()) return key.status();
  m.key_pem = *std::move(key);
  return m;
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsMaterial& tls) {
  if (tls.plaintext) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions opts(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  opts.pem_root_certs = tls.ca_pem;
  opts.pem_key_cert_pairs.push_back({tls.key_pem, tls.cert_pem});
  return grpc::SslServerCredentials(opts);
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const TlsMaterial& tls) {
  if (tls.plaintext) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions opts;
  opts.pem_root_certs = tls.ca_pem;
  opts.pem_private_key = tls.key_pem;
  opts.pem_cert_chain = tls.cert_pem;
  return grpc::SslCredentials(opts);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> Dial(const std::string& address,
                                                    const TlsOptions& options,
                                                    absl::string_view who,
                                                    grpc::ChannelArguments args) {
  auto tls = LoadTls(options, /*need_cert=*/false, who);
  if (!tls.ok()) return tls.status();
  // The one message limit (common/grpc_limits.h).
  args.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
  args.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
  return grpc::CreateCustomChannel(address, ChannelCredentials(*tls), args);
}

const char* RoleName(Role role) {
  switch (role) {
    case Role::kAdmin: return "admin";
    case Role::kShard: return "shard";
    case Role::kTrainer: return "trainer";
    case Role::kNone: break;
  }
  return "none";
}

Role RoleOfCommonName(absl::string_view cn) {
  const size_t colon = cn.find(':');
  const absl::string_view prefix = cn.substr(0, colon);
  if (colon == absl::string_view::npos && cn != "admin") return Role::kNone;
  if (prefix == "admin") return Role::kAdmin;
  if (prefix == "shard") return Role::kShard;
  if (prefix == "trainer") return Role::kTrainer;
  return Role::kNone;
}

Caller IdentifyCaller(const grpc::ServerContextBase& ctx, bool plaintext) {
  Caller c;
  c.plaintext = plaintext;
  const auto& md = ctx.client_metadata();
  auto it = md.find(kAuthorizationKey);
  if (it != md.end()) {
    const absl::string_view v(it->second.data(), it->second.size());
    if (absl::StartsWith(v, "Bearer ")) c.token = std::string(v.substr(7));
  }
  if (plaintext) {
    c.role = Role::kAdmin;
    c.identity = "plaintext";
    return c;
  }
  std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return c;
  const std::vector<grpc::string_ref> cns = auth->FindPropertyValues("x509_common_name");
  if (cns.size() != 1) return c;
  c.identity = std::string(cns[0].data(), cns[0].size());
  c.role = RoleOfCommonName(c.identity);
  return c;
}

absl::StatusOr<std::string> NewToken() {
  unsigned char raw[32];
  FILE* f = std::fopen("/dev/urandom", "rb");
  const bool ok = f != nullptr && std::fread(raw, 1, sizeof(raw), f) == sizeof(raw);
  if (f != nullptr) std::fclose(f);
  if (!ok) return absl::InternalError("cannot read /dev/urandom for a job token");
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(64);
  for (unsigned char b : raw) {
    out.push_back(kHex[b >> 4]);
    out.push_back(kHex[b & 15]);
  }
  return out;
}

absl::Status CheckToken(absl::string_view token) {
  if (token.size() < 32 || token.size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a job token must be 32 to 256 characters (it has ", token.size(),
        "); `openssl rand -hex 32` makes one"));
  }
  for (char ch : token) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                    (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '~' ||
                    ch == '+' || ch == '/' || ch == '=' || ch == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          "a job token may hold only letters, digits and . _ ~ + / = -");
    }
  }
  return absl::OkStatus();
}

bool TokensEqual(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string HmacSha256(absl::string_view key, absl::string_view message) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &len);
  return std::string(reinterpret_cast<const char*>(out), len);
}

std::string JobDataPlaneKey(absl::string_view cluster_key, uint64_t job_id) {
  return HmacSha256(cluster_key, absl::StrCat("optimus job data plane ", job_id));
}

std::string WorkerIdentity(uint64_t job_id, uint32_t rank) {
  return absl::StrCat("worker:", job_id, ":", rank);
}

std::string ShardIdentity(uint64_t shard_id) { return absl::StrCat("shard:", shard_id); }

std::string DataPlaneProof(absl::string_view key, absl::string_view challenge,
                           absl::string_view identity) {
  return HmacSha256(key, absl::StrCat(challenge, "|", identity));
}

absl::Status CheckDataPlaneProof(absl::string_view key, absl::string_view challenge,
                                 absl::string_view identity, absl::string_view proof) {
  if (challenge.size() != 32) return absl::UnauthenticatedError("no valid challenge");
  if (!TokensEqual(DataPlaneProof(key, challenge, identity), proof)) {
    return absl::UnauthenticatedError(
        absl::StrCat("the proof for \"", identity, "\" does not check out"));
  }
  return absl::OkStatus();
}

}  // namespace security
}  // namespace optimus
