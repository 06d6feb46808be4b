// The one gRPC message size limit of optimus, for every channel and server
// (coordinator, shards' coordinator link, clients, optimusctl, the Python
// binding, test harnesses and benches): a job's whole map travels in one
// CreateJob / JoinJob / GetJob / LoadJob message, so a map the coordinator
// accepts must be one every reader can take. The coordinator refuses a job
// whose map would not fit (RESOURCE_EXHAUSTED) before it places anything.
// Header-only; no state.
#ifndef OPTIMUS_COMMON_GRPC_LIMITS_H_
#define OPTIMUS_COMMON_GRPC_LIMITS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"

namespace optimus {

// 64 MiB: a map costs ~25-30 bytes per chunk, so about two million chunks
// (--max_chunks_per_job defaults well below) with room for the rest of the
// message. Raising it raises what one message can make every reader buffer.
inline constexpr int kMaxGrpcMessageBytes = 64 << 20;

// Channel arguments carrying the limit both ways; add other settings to them.
inline grpc::ChannelArguments LimitedChannelArgs() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
  args.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
  return args;
}

// grpc::CreateChannel with the limit.
inline std::shared_ptr<grpc::Channel> CreateLimitedChannel(
    const std::string& target, const std::shared_ptr<grpc::ChannelCredentials>& creds) {
  return grpc::CreateCustomChannel(target, creds, LimitedChannelArgs());
}

// Sets the limit on a server being built.
inline void ApplyGrpcLimits(grpc::ServerBuilder& builder) {
  builder.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
  builder.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
}

}  // namespace optimus

#endif  // OPTIMUS_COMMON_GRPC_LIMITS_H_
