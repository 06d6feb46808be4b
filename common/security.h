// Who may talk to optimus: TLS for every gRPC connection, the caller's
// role from its client certificate, per-job tokens, and the HMAC the data
// plane's handshake proves a token with.
//
// Certificates come from one folder, laid out as a Kubernetes TLS Secret
// with its CA (what cert-manager writes, and what scripts/make_local_ca.sh
// makes for the local cluster and the tests):
//
//   <dir>/ca.crt   the cluster's CA: peers are verified against it
//   <dir>/tls.crt  this process's certificate (server, shard, admin, trainer)
//   <dir>/tls.key  its private key
//
// A client certificate's role is the prefix of its subject common name:
//   admin:<who>    everything (drain, forget, delete, restore, status ...)
//   shard:<who>    register, then heartbeat only as the shard it registered
//   trainer:<who>  create jobs (and hold the tokens it is given back)
// A worker needs no certificate: it proves a job's token (sent as
// "authorization: Bearer <token>" on each call), which gives it that job
// and nothing else.
//
// Plain-text mode (no TLS, no authentication: every caller is an admin)
// exists for the local cluster and tests, only when asked for
// (--insecure_plaintext or OPTIMUS_INSECURE_PLAINTEXT=1), and says so
// loudly in the log.
#ifndef OPTIMUS_COMMON_SECURITY_H_
#define OPTIMUS_COMMON_SECURITY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace optimus {
namespace security {

// Environment variables read when options leave the choice open.
inline constexpr char kTlsDirEnv[] = "OPTIMUS_TLS_DIR";
inline constexpr char kPlaintextEnv[] = "OPTIMUS_INSECURE_PLAINTEXT";
inline constexpr char kJobTokenEnv[] = "OPTIMUS_JOB_TOKEN";
// gRPC metadata key carrying "Bearer <token>".
inline constexpr char kAuthorizationKey[] = "authorization";

struct TlsOptions {
  // Folder with ca.crt, tls.crt, tls.key. Empty: $OPTIMUS_TLS_DIR.
  std::string dir;
  // No TLS and no authentication. Also set by OPTIMUS_INSECURE_PLAINTEXT=1
  // when dir and $OPTIMUS_TLS_DIR are empty.
  bool plaintext = false;
};

// What TlsOptions resolved to, with the files read.
struct TlsMaterial {
  bool plaintext = false;
  std::string dir;
  std::string ca_pem;
  std::string cert_pem;  // Empty when the folder has no tls.crt (a worker).
  std::string key_pem;
};

// Resolves `options` against the environment and reads the files. Neither a
// folder nor plaintext asked for is an error that says how to choose.
// `need_cert`: tls.crt and tls.key must be there (servers, shards).
// `who` names the program in messages and in the plaintext warning.
absl::StatusOr<TlsMaterial> LoadTls(const TlsOptions& options, bool need_cert,
                                    absl::string_view who);

// Server credentials: TLS with this process's certificate; client
// certificates are requested and, when given, verified against the CA.
// Plaintext: insecure ones.
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const TlsMaterial& tls);
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const TlsMaterial& tls);

// A channel to `address` under `options` (see LoadTls), with `args` and
// the one message limit (common/grpc_limits.h).
absl::StatusOr<std::shared_ptr<grpc::Channel>> Dial(const std::string& address,
                                                    const TlsOptions& options,
                                                    absl::string_view who,
                                                    grpc::ChannelArguments args = {});

enum class Role { kNone, kAdmin, kShard, kTrainer };
const char* RoleName(Role role);

// Who made a call: the role and name from its verified client certificate
// (kNone without one), and the bearer token it sent (may be empty).
struct Caller {
  Role role = Role::kNone;
  std::string identity;  // The certificate's common name, e.g. "shard:dpu-17".
  std::string token;
  bool plaintext = false;  // The server runs without TLS: authorization is off.
  std::string peer;        // Its address, for logs.
};
Caller IdentifyCaller(const grpc::ServerContextBase& ctx, bool plaintext);

// The role a certificate common name grants.
Role RoleOfCommonName(absl::string_view cn);

// 32 random bytes from the kernel, hex: 64 characters.
absl::StatusOr<std::string> NewToken();
// A token a creator may choose (OPTIMUS_JOB_TOKEN): 32 to 256 characters of
// [A-Za-z0-9._~+/=-]. InvalidArgument otherwise.
absl::Status CheckToken(absl::string_view token);
// Compares in time independent of where they differ.
bool TokensEqual(absl::string_view a, absl::string_view b);
// HMAC-SHA256(key, message), 32 raw bytes.
std::string HmacSha256(absl::string_view key, absl::string_view message);

// ---- The data plane's handshake (transport::WorkerOptions::verify_peer) ----
// The coordinator keeps one cluster secret (TLS mode); shards get it at
// registration, a worker gets its job's key when it joins (proving the
// job's token to the coordinator). A peer claims an identity and proves it
// with HmacSha256(key, challenge + identity):
//   "worker:<job id>:<rank>"  with JobDataPlaneKey(cluster secret, job id)
//   "shard:<shard id>"        with the cluster secret itself
std::string JobDataPlaneKey(absl::string_view cluster_key, uint64_t job_id);
std::string WorkerIdentity(uint64_t job_id, uint32_t rank);
std::string ShardIdentity(uint64_t shard_id);
std::string DataPlaneProof(absl::string_view key, absl::string_view challenge,
                           absl::string_view identity);
// OK when `proof` is DataPlaneProof(key, challenge, identity) over a
// 32-byte challenge; UNAUTHENTICATED otherwise.
absl::Status CheckDataPlaneProof(absl::string_view key, absl::string_view challenge,
                                 absl::string_view identity, absl::string_view proof);

}  // namespace security
}  // namespace optimus

#endif  // OPTIMUS_COMMON_SECURITY_H_
