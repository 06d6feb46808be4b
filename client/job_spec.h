// A JobDef as the coordinator's v1::JobSpec: what Client::CreateJob sends,
// for tools that create a job without a data plane of their own
// (optimusctl job create -f). Pure; thread-safe.
#ifndef OPTIMUS_CLIENT_JOB_SPEC_H_
#define OPTIMUS_CLIENT_JOB_SPEC_H_

#include "client/client.h"
#include "proto/optimus.pb.h"

namespace optimus {
namespace client {

// Every field of `def`, unchecked (the coordinator validates the spec and
// fills the optimizer's defaults).
v1::JobSpec ToJobSpec(const JobDef& def);

}  // namespace client
}  // namespace optimus

#endif  // OPTIMUS_CLIENT_JOB_SPEC_H_
