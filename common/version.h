// The optimus release the binaries are built from, one constant for every
// binary: `optimus-coord --version` and `optimus-shard --version` print it,
// and /metrics exports it as optimus_build_info{version=...}. Kept equal to
// the Helm chart's appVersion (deploy/helm/optimus/Chart.yaml).
#ifndef OPTIMUS_COMMON_VERSION_H_
#define OPTIMUS_COMMON_VERSION_H_

#include <string>

namespace optimus {

inline constexpr char kOptimusVersion[] = "0.1.0";

// "<binary> <version>\n", what --version prints (absl's flags call it).
inline std::string VersionLine(const std::string& binary) {
  return binary + " " + kOptimusVersion + "\n";
}

}  // namespace optimus

#endif  // OPTIMUS_COMMON_VERSION_H_
