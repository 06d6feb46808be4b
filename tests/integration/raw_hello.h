// A raw UCX peer for attack tests: says hello to a shard the way
// transport/ucx.cc's hello reads it (the sender's instance id and a connect
// token in the header, then a name; an address as the payload; eager, with
// a reply endpoint), under made-up identities and with any address, and
// may follow a hello with a request as if the handshake were done.
#ifndef OPTIMUS_TESTS_INTEGRATION_RAW_HELLO_H_
#define OPTIMUS_TESTS_INTEGRATION_RAW_HELLO_H_

#include <ucp/api/ucp.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace optimus {
namespace harness {

// A raw UCX worker that says hello to a shard under many made-up worker
// identities, as transport/ucx.cc's hello reads them: the sender's instance
// id and a connect token in the header (then a name), its address as the
// payload, eager and with a reply endpoint.
class HelloFlood {
 public:
  explicit HelloFlood(const std::string& shard_address) {
    ucp_config_t* config = nullptr;
    EXPECT_EQ(ucp_config_read(nullptr, nullptr, &config), UCS_OK);
    ucp_config_modify(config, "NET_DEVICES", "lo");
    ucp_params_t params;
    std::memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    EXPECT_EQ(ucp_init(&params, config, &context_), UCS_OK);
    ucp_config_release(config);
    ucp_worker_params_t wp;
    std::memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    EXPECT_EQ(ucp_worker_create(context_, &wp, &worker_), UCS_OK);
    ucp_address_t* addr = nullptr;
    size_t len = 0;
    EXPECT_EQ(ucp_worker_get_address(worker_, &addr, &len), UCS_OK);
    address_.assign(reinterpret_cast<const char*>(addr), len);
    ucp_worker_release_address(worker_, addr);
    // The shard answers each hello it takes (AM 1): swallow the answers.
    ucp_am_handler_param_t hp;
    std::memset(&hp, 0, sizeof(hp));
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    hp.id = 1;
    hp.cb = [](void* arg, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*) {
      ++*static_cast<uint64_t*>(arg);
      return UCS_OK;
    };
    hp.arg = &answers_;
    EXPECT_EQ(ucp_worker_set_am_recv_handler(worker_, &hp), UCS_OK);
    ucp_ep_params_t ep;
    std::memset(&ep, 0, sizeof(ep));
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep.address = reinterpret_cast<const ucp_address_t*>(shard_address.data());
    EXPECT_EQ(ucp_ep_create(worker_, &ep, &ep_), UCS_OK);
  }
  ~HelloFlood() {
    if (ep_ != nullptr) {
      ucp_request_param_t p;
      std::memset(&p, 0, sizeof(p));
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t st = ucp_ep_close_nbx(ep_, &p);
      while (st != nullptr && !UCS_PTR_IS_ERR(st) &&
             ucp_request_check_status(st) == UCS_INPROGRESS) {
        ucp_worker_progress(worker_);
      }
      if (st != nullptr && !UCS_PTR_IS_ERR(st)) ucp_request_free(st);
    }
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  // Sends one hello from instance `instance` carrying `address` as the
  // sender's address, then, if `request` is not empty, active message
  // `ucx_am_id` with `request` as its header from the same instance, as
  // if the handshake had been done.
  void SendAs(uint64_t instance, const std::string& address, uint32_t ucx_am_id = 0,
              const std::string& request = "") {
    std::vector<ucs_status_ptr_t> inflight;
    std::string header(16, '\0');
    const uint64_t token = 1;
    std::memcpy(&header[0], &instance, 8);
    std::memcpy(&header[8], &token, 8);
    header += "garbage";
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t st = ucp_am_send_nbx(ep_, 0, header.data(), header.size(),
                                          address.data(), address.size(), &p);
    if (st != nullptr && !UCS_PTR_IS_ERR(st)) inflight.push_back(st);
    if (!request.empty()) {
      std::string rh(8, '\0');
      std::memcpy(&rh[0], &instance, 8);
      rh += request;
      st = ucp_am_send_nbx(ep_, ucx_am_id, rh.data(), rh.size(), nullptr, 0, &p);
      if (st != nullptr && !UCS_PTR_IS_ERR(st)) inflight.push_back(st);
    }
    Drain(&inflight);
  }

  // Sends `n` hellos, each from a new instance id; waits for each to go
  // out (a few in flight at a time).
  void Send(uint64_t n) {
    std::vector<ucs_status_ptr_t> inflight;
    for (uint64_t i = 0; i < n; ++i) {
      std::string header(16, '\0');
      const uint64_t instance = 0x5eed000000000000ull + i;
      const uint64_t token = i + 1;
      std::memcpy(&header[0], &instance, 8);
      std::memcpy(&header[8], &token, 8);
      header += "forged";
      ucp_request_param_t p;
      std::memset(&p, 0, sizeof(p));
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
      // The header is copied by UCX for an eager send; the payload (our
      // address) lives as long as this object.
      ucs_status_ptr_t st = ucp_am_send_nbx(ep_, 0, header.data(), header.size(),
                                            address_.data(), address_.size(), &p);
      if (st != nullptr && !UCS_PTR_IS_ERR(st)) inflight.push_back(st);
      if (inflight.size() >= 64 || i + 1 == n) Drain(&inflight);
      ucp_worker_progress(worker_);
    }
  }
  // Progresses until the shard's answers stop coming (they come for the
  // hellos it kept room for).
  void Progress(absl::Duration d) {
    const absl::Time end = absl::Now() + d;
    while (absl::Now() < end) ucp_worker_progress(worker_);
  }

 private:
  void Drain(std::vector<ucs_status_ptr_t>* inflight) {
    for (ucs_status_ptr_t st : *inflight) {
      while (ucp_request_check_status(st) == UCS_INPROGRESS) ucp_worker_progress(worker_);
      ucp_request_free(st);
    }
    inflight->clear();
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  std::string address_;
  uint64_t answers_ = 0;
};

}  // namespace harness
}  // namespace optimus

#endif  // OPTIMUS_TESTS_INTEGRATION_RAW_HELLO_H_
