// liboptimus: what a training process links to use optimus. A Client talks to
// the coordinator (gRPC) to create or join a job and get its shard map, then
// pushes gradients and pulls parameters straight to and from the shard servers
// over UCX, split by the map into chunks.
//
// Push and Pull return at once with a Ticket; Wait(ticket, timeout) blocks
// until every chunk of that operation is answered. The buffers handed to Push
// and Pull belong to the caller and must not change (Push) or be read (Pull)
// until Wait returns OK or an error other than DEADLINE_EXCEEDED. A push's
// buffer must moreover stay unchanged until the Pull of the next version of
// that tensor has completed: if a shard fails over in between, the client
// sends the push again to the promoted backup.
//
// Registered buffers: the client registers the buffers it sends from and
// receives into with the data plane once and reuses the registration for
// every later transfer (a rendezvous then pins no pages per transfer):
// buffers given to RegisterBuffer (long-lived staging buffers) until
// ForgetBuffer, and Push/Pull buffers of at least
// ClientOptions::registration_min_bytes through a cache keyed by address
// range (least recently used dropped beyond registration_cache_bytes).
// Before freeing or unmapping memory you pushed from or pulled into, call
// ForgetBuffer on it (or turn the cache off): on a transport that pins
// pages (RDMA), a registration kept for an address that comes back as
// another buffer would move bytes to and from the old pages.
//
// Failover is transparent: when a shard fails, or the coordinator moves
// chunks (a drain), requests in flight are resent under the job's new shard
// map and Wait just takes longer (about the lease). Only when the job cannot
// go on (a shard was lost without a replica: the job FAILED; or the job is
// gone from the coordinator: deleted, or replaced by the job a rollback
// restored under its name) do the waiting tickets fail, with UNAVAILABLE.
// All methods are thread-safe.
#ifndef OPTIMUS_CLIENT_CLIENT_H_
#define OPTIMUS_CLIENT_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/registration_cache.h"
#include "common/dtype.h"
#include "common/security.h"
#include "transport/transport.h"

namespace optimus {
namespace client {

struct ClientOptions {
  // gRPC address of optimus-coord, "host:port". Required. Several,
  // "host:port,host:port" (a leader and its standbys, state in etcd): the
  // client's calls go to whichever leads (common/coordinator_channels.h);
  // a call made during a takeover fails UNAVAILABLE and is retried where
  // the client retries (Leave, the recovery of a failed-over request;
  // JoinOrCreate's joins), reaching the new leader. INVALID_ARGUMENT from
  // Connect for a malformed list.
  std::string coordinator_address;
  // TLS to the coordinator (its CA; a client certificate only to create
  // jobs: "trainer:<who>" or "admin:<who>"), or plain text when asked for.
  // Left empty: $OPTIMUS_TLS_DIR or $OPTIMUS_INSECURE_PLAINTEXT, else
  // Connect fails saying how to choose. See common/security.h.
  security::TlsOptions tls;
  // The job's token: what this worker proves to join the job and reach its
  // chunks. CreateJob sends it when set (the job then takes it; 32 to 256
  // characters) and keeps the one the coordinator returns when not. Empty:
  // $OPTIMUS_JOB_TOKEN.
  std::string job_token;
  // Deadline for each control-plane RPC. Default 10 s.
  absl::Duration rpc_timeout = absl::Seconds(10);
  // How long Join waits for the shards to load the job, and how long a
  // failed-over request waits for a new shard map. Default 60 s.
  absl::Duration ready_timeout = absl::Seconds(60);
  // UCX settings for the data plane.
  transport::WorkerOptions transport;
  // Push and Pull buffers of at least registration_min_bytes that are not
  // in a RegisterBuffer'ed range are registered on first use and kept, up to
  // registration_cache_bytes (the least recently used dropped first); see
  // "Registered buffers" above. Smaller ones travel eagerly (copied), where
  // a registration buys nothing. 0 bytes: no cache (the transport registers
  // per transfer; RegisterBuffer still works). Costs pinned memory on
  // transports that pin pages. Defaults 4 GiB and 64 KiB.
  uint64_t registration_cache_bytes = uint64_t{4} << 30;
  uint64_t registration_min_bytes = 64 * 1024;
  // For tests: makes the data-plane worker instead of
  // transport::Worker::Create (e.g. to wrap it and count what the client
  // asks of it). Default: none.
  std::function<absl::StatusOr<std::unique_ptr<transport::Worker>>(
      const transport::WorkerOptions&)>
      make_worker;
};

// Lion uses beta1, beta2, lr and weight_decay, and keeps one moment.
enum class Optimizer { kAdamW, kAdam, kSgd, kLion };

// A field left 0 takes the optimizer's own default (kernels/optimizer_spec.h:
// Adam/AdamW betas 0.9/0.999 and eps 1e-8, Lion betas 0.9/0.99), filled by
// the coordinator.
struct OptimizerSpec {
  Optimizer kind = Optimizer::kAdamW;
  float lr = 1e-3f;
  float beta1 = 0.0f;
  float beta2 = 0.0f;
  float eps = 0.0f;
  float weight_decay = 0.0f;
  float momentum = 0.0f;   // SGD only.
  // Multiplies the summed gradient; 0 means 1/world_size (the average).
  float grad_scale = 0.0f;
};

struct TensorDef {
  std::string name;
  std::vector<int64_t> shape;
  // Index into JobDef::param_groups (0 when there are none).
  uint32_t group = 0;
  // Never updated (torch: requires_grad=False): its pushes carry no
  // gradient, whatever Push is given, and it keeps its initial values.
  bool frozen = false;
};

// A parameter group, as in torch.optim's param_groups: an unset field takes
// the job's OptimizerSpec value. The group's learning rate is each step's
// learning rate times lr_mult.
struct ParamGroup {
  std::string name;
  std::optional<float> weight_decay;
  std::optional<float> lr_mult;
  std::optional<float> beta1;
  std::optional<float> beta2;
  std::optional<float> momentum;
};

// When the coordinator checkpoints the job on its own (it needs
// --checkpoint_dir). Zero fields are off.
struct CheckpointPolicy {
  uint64_t every_steps = 0;    // After this many more steps are applied.
  uint64_t every_seconds = 0;  // When the last checkpoint is this old.
  uint32_t keep_last = 0;      // Complete checkpoints kept; 0 means 3.
};

struct JobDef {
  std::string name;
  uint32_t world_size = 1;
  std::vector<TensorDef> tensors;
  OptimizerSpec optimizer;
  DType grad_dtype = DType::kBf16;
  DType param_dtype = DType::kBf16;
  // Chunk size in bytes of one chunk's gradient push; 0 means the
  // coordinator's 4 MiB. Used when max_chunk_bytes is 0.
  uint64_t chunk_payload_bytes = 0;
  // Chunk size limit in bytes of fp32 state (overrides chunk_payload_bytes);
  // 0: from chunk_payload_bytes.
  uint64_t max_chunk_bytes = 0;
  CheckpointPolicy checkpoint;
  // Backups per chunk: 0, or 1 (each chunk also lives on a second shard,
  // which takes over without losing a step when the first fails).
  uint32_t replication = 0;
  // Parameter groups (TensorDef::group indexes them); empty: one group with
  // the optimizer's settings.
  std::vector<ParamGroup> param_groups;
  // > 0: every step's averaged gradient is clipped to this global L2 norm
  // over the whole job, as torch.nn.utils.clip_grad_norm_ would on one
  // process. Costs one small round per step (see Push).
  float max_grad_norm = 0.0f;
  // A step whose averaged gradient holds an inf or NaN anywhere in the job
  // is skipped by every chunk (GradScaler's rule) and reported (found_inf).
  // Costs the same round as clipping.
  bool skip_nonfinite = true;
};

// The usual "no weight decay on biases and norm weights" in one line: puts
// every tensor of `def` with fewer than 2 dimensions into a group "no_decay"
// (weight decay 0) and the rest into a group "decay" (weight_decay),
// replacing def->param_groups.
void SplitDecayGroups(JobDef* def, float weight_decay);

// What travels with one push (every rank's push of a step must agree).
struct PushOptions {
  // The step's learning rate (before its group's lr_mult); unset: the job's
  // OptimizerSpec::lr. Any schedule: the trainer computes it per step. 0 is
  // a step with learning rate 0 (e.g. the first step of a warmup from 0:
  // the moments move, the parameters do not).
  std::optional<float> lr;
  // Multiplies the averaged gradient: 1 / the loss scale of mixed-precision
  // training (GradScaler's unscale). 0 means 1.
  float grad_mult = 0.0f;
};

// What the shards decided for one step (jobs with max_grad_norm or
// skip_nonfinite; see Client::StepResult).
struct StepReport {
  // The global L2 norm of the step's averaged gradient (after grad_mult,
  // before clipping), as clip_grad_norm_ returns it; inf/NaN when found_inf.
  double grad_norm = 0.0;
  float clip_coef = 1.0f;   // What the gradient was multiplied by.
  bool found_inf = false;   // The gradient held an inf or NaN.
  bool skipped = false;     // The step left every tensor unchanged.
};

// One tensor's optimizer state, to start a job from (e.g. a torch
// optimizer's state_dict): num_elems floats each. m and v as the
// optimizer's layout names them (Adam/AdamW exp_avg, exp_avg_sq; SGD
// momentum_buffer in m; Lion exp_avg in m); null where the layout has none.
struct TensorState {
  const float* master = nullptr;
  const float* m = nullptr;
  const float* v = nullptr;
  uint64_t steps = 0;     // Optimizer steps these values have seen (torch's 'step').
  float last_lr = 0.0f;   // The last step's learning rate (informational).
};

// Identifies one Push or Pull until Wait consumes it.
using Ticket = uint64_t;

struct TensorInfo {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t num_elems = 0;
  uint32_t num_chunks = 0;
  uint32_t group = 0;     // Index into the job's parameter groups.
  bool frozen = false;
};

class Client {
 public:
  // Starts the data plane and opens the control channel. Does not contact the
  // coordinator yet.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  virtual ~Client() = default;

  // Creates the job. ALREADY_EXISTS if a job of that name exists,
  // RESOURCE_EXHAUSTED (with the numbers) if its state does not fit on the
  // live shards, INVALID_ARGUMENT for a bad definition.
  virtual absl::Status CreateJob(const JobDef& def) = 0;

  // The job token this client uses (ClientOptions.job_token, or the one
  // CreateJob got back): hand it to the other ranks (OPTIMUS_JOB_TOKEN).
  virtual std::string job_token() const = 0;

  // Joins job `name` as `rank` of `world_size`, waits until its shards are
  // ready (ready_timeout) and connects to them.
  virtual absl::Status Join(const std::string& name, uint32_t rank, uint32_t world_size) = 0;

  // Tells the coordinator that this rank is done with the joined job
  // (LeaveJob), so that the job can be deleted (optimusctl job delete)
  // without --force once every rank has left. Call it when training ends,
  // after the last Wait. Idempotent; a rank that left may Join the job again
  // with a new client. It does not stop the data plane: the client stays
  // usable until destroyed, but a job all of whose ranks left may be deleted
  // under it. FAILED_PRECONDITION before Join; NOT_FOUND when the job is gone
  // (deleted, or replaced by a restore); UNAVAILABLE when the coordinator
  // cannot be reached (an UNAVAILABLE answer is tried again within
  // rpc_timeout first: a coordinator restarting, or a standby taking over).
  virtual absl::Status Leave() = 0;

  // The joined job's tensors, in definition order; index = position.
  virtual const std::vector<TensorInfo>& tensors() const = 0;
  virtual absl::StatusOr<uint32_t> TensorIndex(const std::string& name) const = 0;
  virtual uint32_t rank() const = 0;
  virtual uint32_t world_size() const = 0;
  virtual DType grad_dtype() const = 0;
  virtual DType param_dtype() const = 0;
  // The joined job's optimizer and how many parameter groups it has (0: the
  // implicit one).
  virtual Optimizer optimizer() const = 0;
  virtual uint32_t num_param_groups() const = 0;
  // The first step to run after Join: 1 for a new job (rank 0 calls
  // InitTensor first), S for a job restored from a checkpoint of step S
  // (its values are loaded: pull version S, push step S, no InitTensor).
  virtual uint64_t resume_step() const = 0;
  // The learning rate of the last step before the checkpoint a restored job
  // started from (0 for a new job): a trainer whose schedule is not a
  // function of the step can take it up from there.
  virtual float resume_lr() const = 0;
  // The joined job's id and the shard map epoch in use (it grows when the
  // coordinator fails a shard over or moves chunks).
  virtual uint64_t job_id() const = 0;
  virtual uint64_t map_epoch() const = 0;
  // Requests sent again after a failover or map change, so far.
  virtual uint64_t requests_resent() const = 0;
  // Replies dropped because they answered no request outstanding at the
  // peer that sent them (a request id sent to another shard, or one already
  // answered): a shard cannot answer, or fence, another shard's requests.
  virtual uint64_t replies_refused() const = 0;
  // The transports the data plane's endpoints use so far, as the transport
  // names them (e.g. "tcp", "sysv,cma"; empty before any request or when
  // the transport does not say). For logs and benchmarks.
  virtual std::string transports_in_use() const = 0;

  // Sends the initial fp32 values of a tensor (num_elems floats); they become
  // version 1. One rank (by convention 0) does this; the others Pull version
  // 1, which waits for it. Blocking.
  virtual absl::Status InitTensor(uint32_t tensor, const float* values, size_t num_elems) = 0;

  // Like InitTensor, with the optimizer's moments and step count too (a run
  // moving onto optimus without restarting its moments). Blocking.
  virtual absl::Status InitTensorState(uint32_t tensor, const TensorState& state,
                                       size_t num_elems) = 0;

  // Pushes this rank's gradient for `step` (>= 1), num_elems of grad_dtype().
  // grad == nullptr: this rank has no gradient for the tensor this step (a
  // tensor no rank has one for is left alone, as torch skips parameters
  // whose .grad is None; ranks without one count as zero in the average).
  // Every tensor must be pushed every step. With clipping or
  // skip_nonfinite, the push is answered once every rank's push of the
  // chunk is in (the answer carries the chunk's partial norm), and the
  // client then commits the step to every chunk by itself.
  absl::StatusOr<Ticket> Push(uint32_t tensor, uint64_t step, const void* grad,
                              size_t num_elems) {
    return Push(tensor, step, grad, num_elems, PushOptions{});
  }
  virtual absl::StatusOr<Ticket> Push(uint32_t tensor, uint64_t step, const void* grad,
                                      size_t num_elems, const PushOptions& options) = 0;

  // What the shards decided for `step`: available once this rank's pushes
  // of every tensor for it are answered; waits up to `timeout` for that
  // (DEADLINE_EXCEEDED). FAILED_PRECONDITION for a job that neither clips
  // nor skips non-finite steps (there is no round to report); NOT_FOUND for
  // a step this client pushed nothing for or forgot (it keeps the last 64).
  virtual absl::StatusOr<StepReport> StepResult(uint64_t step, absl::Duration timeout) = 0;

  // Pulls the parameters at `version` (>= 1) into dst, num_elems of
  // param_dtype(). A version one ahead of the latest is answered once all
  // workers' pushes for it are in.
  virtual absl::StatusOr<Ticket> Pull(uint32_t tensor, uint64_t version, void* dst,
                                      size_t num_elems) = 0;

  // Batching small chunks: requests issued on this thread between Cork()
  // and Uncork() are sent at Uncork(), those whose payload is at most
  // kBatchItemBytes (and pulls and commits) in one message per shard
  // (wire::Op::kBatch; each is still answered and waited for on its own
  // ticket). For models with many small tensors: one message per shard
  // instead of one per tensor. Nested calls count; the outermost Uncork
  // sends. BatchScope does both. The bound: a batched payload is copied
  // twice more (into the batch here, out of it on the shard), which costs
  // more than a message of its own from 16 KiB up (docs/benchmarks.md,
  // "Corked pushes").
  static constexpr size_t kBatchItemBytes = 8 * 1024;
  virtual void Cork() = 0;
  virtual void Uncork() = 0;

  // Waits for a ticket. OK; DEADLINE_EXCEEDED (the ticket stays valid; wait
  // again); NOT_FOUND for an unknown or already-waited ticket; otherwise the
  // first error a shard answered for any chunk of it.
  virtual absl::Status Wait(Ticket ticket, absl::Duration timeout) = 0;

  // Registers [data, data + size_bytes) with the data plane, once, for
  // every later Push from or Pull into any part of it, until ForgetBuffer
  // or the client's destruction (never evicted). For buffers that live as
  // long as training (staging buffers). OK at once for a range already
  // registered. INVALID_ARGUMENT for an empty range or one that partly
  // overlaps another RegisterBuffer'ed range; the transport's error when
  // registering fails. Blocks for the registration; call it at setup.
  virtual absl::Status RegisterBuffer(const void* data, size_t size_bytes) = 0;

  // The memory [data, data + size_bytes) is about to be freed or reused for
  // something else: drops every registration overlapping it
  // (RegisterBuffer's and the cache's). Requests in flight keep theirs
  // until they finish. Returns how many were dropped.
  virtual size_t ForgetBuffer(const void* data, size_t size_bytes) = 0;

  // Registrations made, cache hits, evictions, bytes registered.
  virtual RegistrationStats registration_stats() const = 0;
};

// Corks `client` on this thread for its lifetime (see Client::Cork).
class BatchScope {
 public:
  explicit BatchScope(Client* client) : client_(client) { client_->Cork(); }
  ~BatchScope() { client_->Uncork(); }
  BatchScope(const BatchScope&) = delete;
  BatchScope& operator=(const BatchScope&) = delete;

 private:
  Client* client_;
};

}  // namespace client
}  // namespace optimus

#endif  // OPTIMUS_CLIENT_CLIENT_H_
