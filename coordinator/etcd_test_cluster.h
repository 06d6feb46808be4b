// Real etcd for tests: one member or a cluster of three, started as
// processes of Debian's etcd (etcd-server) on loopback, on free ports, with
// their data folders and logs under $TEST_TMPDIR. Tests skip (GTEST_SKIP)
// when the binary is absent: EtcdTestCluster::Binary() is empty then.
#ifndef OPTIMUS_COORDINATOR_ETCD_TEST_CLUSTER_H_
#define OPTIMUS_COORDINATOR_ETCD_TEST_CLUSTER_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace optimus {

// A free TCP port on 127.0.0.1 (bound, read and closed: another process
// could take it before it is used, which the callers' retries cover).
int PickFreePort();

// A folder under $TEST_TMPDIR (or /tmp), created fresh.
std::string TestFolder(const std::string& name);

// Starts `argv` with stdout and stderr appended to `log`; its pid.
absl::StatusOr<pid_t> SpawnLogged(const std::vector<std::string>& argv, const std::string& log);

class EtcdTestCluster {
 public:
  // $OPTIMUS_ETCD_BIN, else /usr/bin/etcd, when executable; else empty.
  static std::string Binary();
  // Why tests skip without it.
  static constexpr char kMissing[] =
      "etcd not installed (/usr/bin/etcd from Debian's etcd-server; scripts/install_deps.sh): "
      "skipping the tests that need a real etcd";

  // Starts `members` members (named m0, m1, ...) and waits until every one
  // answers a read through the cluster's raft leader. Logs:
  // <folder>/m<i>.log.
  static absl::StatusOr<std::unique_ptr<EtcdTestCluster>> Start(int members,
                                                                const std::string& name);
  // SIGKILLs what is still running.
  ~EtcdTestCluster();
  EtcdTestCluster(const EtcdTestCluster&) = delete;
  EtcdTestCluster& operator=(const EtcdTestCluster&) = delete;

  // "127.0.0.1:PORT" per member.
  const std::vector<std::string>& endpoints() const { return endpoints_; }
  // Joined with commas, as --etcd_endpoints takes them.
  std::string endpoints_flag() const;
  // SIGKILLs member `i` and reaps it.
  void Kill(int i);
  const std::string& folder() const { return folder_; }

 private:
  EtcdTestCluster() = default;
  std::string folder_;
  std::vector<std::string> endpoints_;
  std::vector<pid_t> pids_;
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_ETCD_TEST_CLUSTER_H_
