// A gRPC server with no service of its own (every method UNIMPLEMENTED) on
// 127.0.0.1:<argv[1]>, in a process of its own, until its stdin closes: a
// coordinator that listens, for coordinator_channels_test. It runs outside
// the test's process because a server in the same process would poll the
// test's channels too (gRPC's epoll poller is process-wide) and connect
// them whether or not the library does its part.
#include <cstdio>
#include <memory>
#include <string>

#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s PORT\n", argv[0]);
    return 2;
  }
  grpc::CallbackGenericService generic;
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort(std::string("127.0.0.1:") + argv[1], grpc::InsecureServerCredentials(), &port);
  b.RegisterCallbackGenericService(&generic);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "cannot listen on 127.0.0.1:%s\n", argv[1]);
    return 1;
  }
  std::printf("listening\n");
  std::fflush(stdout);
  while (std::getchar() != EOF) {
  }
  server->Shutdown();
  return 0;
}
