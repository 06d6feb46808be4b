// Converts UCX status codes into absl::Status: the one place where UCX's
// error type crosses into optimus code (STYLE.md rule 2). Header-only, no
// state, safe from any thread.
#ifndef OPTIMUS_TRANSPORT_UCX_STATUS_H_
#define OPTIMUS_TRANSPORT_UCX_STATUS_H_

#include <ucs/type/status.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace optimus {
namespace transport {

// Returns OK for UCS_OK (and UCS_INPROGRESS, which is not a failure);
// otherwise an error whose message is "<what>: UCX: <ucs_status_string>".
//   Unavailable: the peer is gone or unreachable (worth retrying elsewhere or
//     later). UCX 1.13 over tcp reports a peer whose sockets closed (a
//     destroyed worker, a killed process) as ENDPOINT_TIMEOUT; over shared
//     memory a killed peer as CONNECTION_RESET, and connecting to a
//     destroyed one as SHMEM_SEGMENT (its segment is gone).
//   Cancelled: the operation was cancelled (e.g. by closing the endpoint).
//   ResourceExhausted: out of memory or other local resources.
//   DeadlineExceeded: a UCX operation timed out (not a peer timeout).
//   InvalidArgument / OutOfRange / NotFound / AlreadyExists /
//   Unimplemented: caller or configuration errors; Internal otherwise.
inline absl::Status FromUcs(ucs_status_t s, absl::string_view what) {
  if (s == UCS_OK || s == UCS_INPROGRESS) return absl::OkStatus();
  const std::string msg = absl::StrCat(what, ": UCX: ", ucs_status_string(s));
  switch (s) {
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_BUSY:
    case UCS_ERR_SHMEM_SEGMENT:
      return absl::UnavailableError(msg);
    case UCS_ERR_CANCELED:
      return absl::CancelledError(msg);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return absl::ResourceExhaustedError(msg);
    case UCS_ERR_TIMED_OUT:
      return absl::DeadlineExceededError(msg);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
    case UCS_ERR_BUFFER_TOO_SMALL:
      return absl::InvalidArgumentError(msg);
    case UCS_ERR_MESSAGE_TRUNCATED:
    case UCS_ERR_OUT_OF_RANGE:
      return absl::OutOfRangeError(msg);
    case UCS_ERR_NO_ELEM:
      return absl::NotFoundError(msg);
    case UCS_ERR_ALREADY_EXISTS:
      return absl::AlreadyExistsError(msg);
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_NOT_IMPLEMENTED:
      return absl::UnimplementedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace transport
}  // namespace optimus

#endif  // OPTIMUS_TRANSPORT_UCX_STATUS_H_
