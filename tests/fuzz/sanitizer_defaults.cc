// Sanitizer settings compiled into every binary of --config=fuzz (.bazelrc
// links this library into each cc_binary and cc_test through
// --custom_malloc), so that tests, the processes they start, fuzzers and
// `bazel run` reproductions all run with the same ones. The environment
// (ASAN_OPTIONS, LSAN_OPTIONS, UBSAN_OPTIONS) still overrides them.
//
// Every entry says why. A report from optimus code is a bug to fix, never
// an entry here.

extern "C" {

// alloc_dealloc_mismatch=0: gRPC's ChannelInit::Builder::Build (libgrpc,
// not instrumented) frees with free() the buffer its inlined
// std::stable_sort took with operator new(nothrow); ASan reports that
// mismatch in every process that starts a gRPC server.
const char* __asan_default_options() { return "alloc_dealloc_mismatch=0"; }

const char* __ubsan_default_options() { return "print_stacktrace=1"; }

// Leaks inside system libraries.
const char* __lsan_default_suppressions() {
  return
      // UCX 1.13.1: ucp_ep_create to the address of a worker that no longer
      // exists fails in the shared-memory endpoint's constructor
      // (uct_mm_ep_t_init: "mm ep failed to connect to remote FIFO"), which
      // returns without freeing the hash of remote segments it had just
      // made (three allocations, ~200 bytes per failed connect;
      // transport_test ConnectToDestroyedWorkerFails). libuct has no frame
      // pointers, so the report's stack ends in libuct itself: the
      // suppression names the library. Leaks of UCX objects that optimus
      // fails to destroy are allocated in libucp and still reported.
      "leak:libuct.so\n"
      // c-ares 1.18.1 (Debian 12's libc-ares2) under gRPC's resolver: each
      // lookup of "localhost" (answered from /etc/hosts) leaves the 10
      // bytes of an ares_strdup of the name unfreed (c-ares issue 439
      // reports the same leak with 1.18.1). The report's stack ends in
      // libcares (no frame pointers): the suppression names the library.
      "leak:libcares.so\n";
}

}  // extern "C"
