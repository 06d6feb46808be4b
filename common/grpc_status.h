// Converts between gRPC's status and absl::Status: the one place where
// gRPC's error type crosses into optimus code (STYLE.md rule 2).
#ifndef OPTIMUS_COMMON_GRPC_STATUS_H_
#define OPTIMUS_COMMON_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace optimus {

inline absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace optimus

#endif  // OPTIMUS_COMMON_GRPC_STATUS_H_
