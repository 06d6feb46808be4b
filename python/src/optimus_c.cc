// optimus._C: the Python binding of liboptimus's Client (client/client.h).
//
// Buffers cross as raw addresses (tensor.data_ptr()) and element counts, so
// this extension links neither libtorch nor its Python bindings; the caller
// keeps the memory alive and unchanged as client.h requires. Every call that
// may block (connecting, creating, joining, waiting, registering) releases
// the GIL. A non-OK absl::Status becomes an exception of optimus._C:
// OptimusError, or the subclass for its code (NotFound, InvalidArgument, ...)
// with the status message and `.code` (the code's name, e.g. "NOT_FOUND").
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/job_config.h"
#include "client/session.h"
#include "common/checkpoint_files.h"
#include "common/dtype.h"
#include "common/coordinator_channels.h"
#include "common/grpc_limits.h"
#include "common/grpc_status.h"
#include "common/security.h"
#include "grpcpp/grpcpp.h"
#include "proto/optimus.grpc.pb.h"

namespace py = pybind11;

namespace optimus {
namespace client {
namespace {

// The exception types, made at import (owned by the module).
struct Errors {
  PyObject* base = nullptr;
  std::map<absl::StatusCode, PyObject*> by_code;
};
Errors* g_errors = nullptr;

PyObject* NewError(py::module_& m, const char* name, PyObject* bases, const char* doc) {
  const std::string qualified = absl::StrCat("optimus._C.", name);
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (type == nullptr) throw py::error_already_set();
  m.add_object(name, py::handle(type));
  return type;
}

void MakeErrors(py::module_& m) {
  g_errors = new Errors;
  g_errors->base = NewError(m, "OptimusError", PyExc_RuntimeError,
                            "An optimus call failed; .code is the status code's name.");
  struct Sub {
    absl::StatusCode code;
    const char* name;
    PyObject* also;  // A builtin it is also (None: only OptimusError).
  };
  const Sub subs[] = {
      {absl::StatusCode::kNotFound, "NotFound", PyExc_LookupError},
      {absl::StatusCode::kInvalidArgument, "InvalidArgument", PyExc_ValueError},
      {absl::StatusCode::kAlreadyExists, "AlreadyExists", nullptr},
      {absl::StatusCode::kFailedPrecondition, "FailedPrecondition", nullptr},
      {absl::StatusCode::kUnavailable, "Unavailable", PyExc_ConnectionError},
      {absl::StatusCode::kDeadlineExceeded, "DeadlineExceeded", PyExc_TimeoutError},
      {absl::StatusCode::kResourceExhausted, "ResourceExhausted", nullptr},
      {absl::StatusCode::kOutOfRange, "OutOfRange", nullptr},
      {absl::StatusCode::kInternal, "Internal", nullptr},
  };
  for (const Sub& s : subs) {
    py::tuple bases = s.also != nullptr
                          ? py::make_tuple(py::handle(g_errors->base), py::handle(s.also))
                          : py::make_tuple(py::handle(g_errors->base));
    g_errors->by_code[s.code] = NewError(m, s.name, bases.ptr(), nullptr);
  }
}

// Raises `s` (not OK) as its Python exception. Needs the GIL.
[[noreturn]] void Raise(const absl::Status& s) {
  auto it = g_errors->by_code.find(s.code());
  PyObject* type = it != g_errors->by_code.end() ? it->second : g_errors->base;
  py::object exc = py::reinterpret_borrow<py::object>(type)(std::string(s.message()));
  exc.attr("code") = absl::StatusCodeToString(s.code());
  PyErr_SetObject(type, exc.ptr());
  throw py::error_already_set();
}

void Check(const absl::Status& s) {
  if (!s.ok()) Raise(s);
}

template <typename T>
T Value(absl::StatusOr<T> v) {
  if (!v.ok()) Raise(v.status());
  return *std::move(v);
}

absl::Duration Secs(double s) {
  return s < 0 ? absl::InfiniteDuration() : absl::Milliseconds(static_cast<int64_t>(s * 1000));
}

DType ParseDType(const std::string& name) { return Value(DTypeFromName(name)); }

std::string OptimizerName(Optimizer o) {
  switch (o) {
    case Optimizer::kAdamW: return "adamw";
    case Optimizer::kAdam: return "adam";
    case Optimizer::kSgd: return "sgd";
    case Optimizer::kLion: return "lion";
  }
  return "adamw";
}

Optimizer ParseOptimizer(const std::string& name) {
  for (Optimizer o : {Optimizer::kAdamW, Optimizer::kAdam, Optimizer::kSgd, Optimizer::kLion}) {
    if (OptimizerName(o) == name) return o;
  }
  Raise(absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer '", name, "' (adamw, adam, sgd or lion)")));
}

const void* Addr(uintptr_t a) { return reinterpret_cast<const void*>(a); }

// The Python object behind optimus._C.Client: owns the Client, drops it
// without the GIL (its threads stop and join).
class PyClient {
 public:
  explicit PyClient(std::unique_ptr<Client> c) : c_(std::move(c)) {}
  ~PyClient() { Close(); }

  void Close() {
    if (c_ == nullptr) return;
    std::unique_ptr<Client> c = std::move(c_);
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      c.reset();
    } else {
      c.reset();
    }
  }

  Client* get() {
    if (c_ == nullptr) Raise(absl::FailedPreconditionError("the client is closed"));
    return c_.get();
  }

  // Hands the client over (a re-join replaces it); this object is closed.
  std::unique_ptr<Client> Release() { return std::move(c_); }

 private:
  std::unique_ptr<Client> c_;
};

std::shared_ptr<PyClient> Connect(const std::string& coordinator, const std::string& transports,
                                  const std::string& net_devices, const std::string& name,
                                  double rpc_timeout_s, double ready_timeout_s,
                                  uint64_t registration_cache_bytes) {
  ClientOptions o;
  o.coordinator_address = coordinator;
  o.transport.transports = transports;
  o.transport.net_devices = net_devices;
  if (!name.empty()) o.transport.name = name;
  o.rpc_timeout = Secs(rpc_timeout_s);
  o.ready_timeout = Secs(ready_timeout_s);
  o.registration_cache_bytes = registration_cache_bytes;
  absl::StatusOr<std::unique_ptr<Client>> c;
  {
    py::gil_scoped_release release;
    c = Client::Connect(o);
  }
  return std::make_shared<PyClient>(Value(std::move(c)));
}

// ---- Optimizer state from the shards, through a checkpoint --------------

// Checkpoints job `name` at version `step` and waits until it is complete;
// returns its folder. The caller makes sure no chunk passes `step` meanwhile
// (its rank has not pushed step `step`): the coordinator orders a checkpoint
// at the step after the highest one applied, so this first waits until the
// shards' reports show every chunk at `step`.
absl::StatusOr<std::string> CheckpointAt(const std::string& coordinator, const std::string& name,
                                         const std::string& token, uint64_t step,
                                         absl::Duration timeout) {
  // TLS as the client's ($OPTIMUS_TLS_DIR or $OPTIMUS_INSECURE_PLAINTEXT).
  // Whichever coordinator leads, when several are given; a call that finds
  // none during a takeover (UNAVAILABLE) is tried again until `timeout`.
  auto channels =
      CoordinatorChannels::Dial(coordinator, security::TlsOptions(), "optimus python");
  if (!channels.ok()) return channels.status();
  LeaderStub<v1::Coordinator> stub(*std::move(channels));
  auto Ctx = [&token](absl::Duration rpc_timeout) {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + rpc_timeout));
    if (!token.empty()) ctx->AddMetadata(security::kAuthorizationKey, "Bearer " + token);
    return ctx;
  };
  const absl::Time deadline = absl::Now() + timeout;
  const absl::Duration rpc = absl::Seconds(10);
  auto late = [&](const std::string& what) {
    return absl::DeadlineExceededError(absl::StrCat(
        "checkpointing job '", name, "' at step ", step, ": ", what, " after ",
        absl::FormatDuration(timeout)));
  };
  // 1. The shards' reports reach the step (heartbeats: about a second).
  for (;;) {
    v1::StatusResponse st;
    absl::Status s =
        FromGrpc(stub.Call(&v1::Coordinator::Stub::Status, Ctx(rpc).get(), v1::StatusRequest(), &st));
    if (absl::IsUnavailable(s) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(200));
      continue;
    }
    if (!s.ok()) return s;
    bool at = false;
    for (const auto& j : st.jobs()) {
      if (j.name() == name && j.current_step() + 1 >= step) at = true;
    }
    if (at) break;
    if (absl::Now() > deadline) return late("the shards did not report the step");
    absl::SleepFor(absl::Milliseconds(100));
  }
  // 2. Order it (another checkpoint of the job in progress: wait for it).
  v1::CheckpointInfo info;
  for (;;) {
    v1::CreateCheckpointRequest req;
    req.set_job_name(name);
    v1::CreateCheckpointResponse resp;
    absl::Status s =
        FromGrpc(stub.Call(&v1::Coordinator::Stub::CreateCheckpoint, Ctx(rpc).get(), req, &resp));
    if (absl::IsUnavailable(s) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(200));
      continue;
    }
    if (s.ok()) {
      info = resp.checkpoint();
      break;
    }
    if (!absl::IsFailedPrecondition(s) || absl::StrContains(s.message(), "off") ||
        absl::StrContains(s.message(), "checkpoint dir") || absl::Now() > deadline) {
      return absl::Status(s.code(), absl::StrCat("checkpointing job '", name, "': ", s.message()));
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  // 3. Until it is complete.
  for (;;) {
    v1::ListCheckpointsRequest req;
    req.set_job_name(name);
    v1::ListCheckpointsResponse resp;
    absl::Status s =
        FromGrpc(stub.Call(&v1::Coordinator::Stub::ListCheckpoints, Ctx(rpc).get(), req, &resp));
    if (absl::IsUnavailable(s) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(200));
      continue;
    }
    if (!s.ok()) return s;
    for (const auto& c : resp.checkpoints()) {
      if (c.checkpoint_id() < info.checkpoint_id()) continue;
      if (c.state() == v1::CHECKPOINT_STATE_COMPLETE) {
        if (c.step() != step) {
          return absl::FailedPreconditionError(absl::StrCat(
              "job '", name, "' was checkpointed at step ", c.step(), ", not ", step,
              " (another rank or a policy checkpoint moved it)"));
        }
        return c.path();
      }
      if (c.state() == v1::CHECKPOINT_STATE_FAILED && c.checkpoint_id() == info.checkpoint_id()) {
        return absl::AbortedError(absl::StrCat("checkpoint of job '", name, "' failed: ",
                                               c.error()));
      }
    }
    if (absl::Now() > deadline) return late("the checkpoint did not complete");
    absl::SleepFor(absl::Milliseconds(50));
  }
}

// client::Session for Python: the joined client (an optimus._C.Client) and
// who this rank is; rejoin() after a rollback swaps in a new client.
class PySession {
 public:
  static std::unique_ptr<PySession> JoinOrCreate(const JobDef& def, const std::string& coordinator,
                                                 int64_t rank, int64_t world_size,
                                                 const std::string& job_name,
                                                 const std::string& job_spec_path,
                                                 double join_timeout_s,
                                                 const std::string& transports,
                                                 const std::string& net_devices,
                                                 double rpc_timeout_s, double ready_timeout_s) {
    auto ps = std::make_unique<PySession>();
    SessionOptions& o = ps->options_;
    o.coordinator = coordinator;
    o.rank = rank;
    o.world_size = world_size;
    o.job_name = job_name;
    o.job_spec_path = job_spec_path;
    o.join_timeout = Secs(join_timeout_s);
    o.client.transport.transports = transports;
    o.client.transport.net_devices = net_devices;
    o.client.transport.name = "worker";  // Session names it worker<rank>.
    o.client.rpc_timeout = Secs(rpc_timeout_s);
    o.client.ready_timeout = Secs(ready_timeout_s);
    absl::StatusOr<Session> s;
    {
      py::gil_scoped_release release;
      s = client::JoinOrCreate(o, def);
    }
    ps->session_ = Value(std::move(s));
    ps->client_ = std::make_shared<PyClient>(std::move(ps->session_.client));
    return ps;
  }

  std::shared_ptr<PyClient> client() const { return client_; }
  const Session& session() const { return session_; }

  std::shared_ptr<PyClient> Rejoin() {
    session_.client = client_->Release();
    absl::Status st;
    {
      py::gil_scoped_release release;
      st = RejoinAfterRollback(options_, &session_);
    }
    Check(st);
    client_ = std::make_shared<PyClient>(std::move(session_.client));
    return client_;
  }

 private:
  SessionOptions options_;
  Session session_;
  std::shared_ptr<PyClient> client_;
};

}  // namespace
}  // namespace client
}  // namespace optimus

PYBIND11_MODULE(_C, m) {
  using namespace optimus;          // NOLINT
  using namespace optimus::client;  // NOLINT
  m.doc() = "optimus._C: liboptimus's Client for Python (see optimus.Client).";
  MakeErrors(m);

  py::class_<OptimizerSpec>(m, "OptimizerSpec")
      .def(py::init<>())
      .def_property(
          "kind", [](const OptimizerSpec& s) { return OptimizerName(s.kind); },
          [](OptimizerSpec& s, const std::string& k) { s.kind = ParseOptimizer(k); })
      .def_readwrite("lr", &OptimizerSpec::lr)
      .def_readwrite("beta1", &OptimizerSpec::beta1)
      .def_readwrite("beta2", &OptimizerSpec::beta2)
      .def_readwrite("eps", &OptimizerSpec::eps)
      .def_readwrite("weight_decay", &OptimizerSpec::weight_decay)
      .def_readwrite("momentum", &OptimizerSpec::momentum)
      .def_readwrite("grad_scale", &OptimizerSpec::grad_scale);

  py::class_<TensorDef>(m, "TensorDef")
      .def(py::init([](std::string name, std::vector<int64_t> shape, uint32_t group, bool frozen) {
             TensorDef d;
             d.name = std::move(name);
             d.shape = std::move(shape);
             d.group = group;
             d.frozen = frozen;
             return d;
           }),
           py::arg("name"), py::arg("shape"), py::arg("group") = 0, py::arg("frozen") = false)
      .def_readwrite("name", &TensorDef::name)
      .def_readwrite("shape", &TensorDef::shape)
      .def_readwrite("group", &TensorDef::group)
      .def_readwrite("frozen", &TensorDef::frozen);

  py::class_<ParamGroup>(m, "ParamGroup")
      .def(py::init<>())
      .def_readwrite("name", &ParamGroup::name)
      .def_readwrite("weight_decay", &ParamGroup::weight_decay)
      .def_readwrite("lr_mult", &ParamGroup::lr_mult)
      .def_readwrite("beta1", &ParamGroup::beta1)
      .def_readwrite("beta2", &ParamGroup::beta2)
      .def_readwrite("momentum", &ParamGroup::momentum);

  py::class_<JobDef>(m, "JobDef")
      .def(py::init<>())
      .def_readwrite("name", &JobDef::name)
      .def_readwrite("world_size", &JobDef::world_size)
      .def_readwrite("tensors", &JobDef::tensors)
      .def_readwrite("optimizer", &JobDef::optimizer)
      .def_property(
          "grad_dtype", [](const JobDef& d) { return std::string(DTypeName(d.grad_dtype)); },
          [](JobDef& d, const std::string& n) { d.grad_dtype = ParseDType(n); })
      .def_property(
          "param_dtype", [](const JobDef& d) { return std::string(DTypeName(d.param_dtype)); },
          [](JobDef& d, const std::string& n) { d.param_dtype = ParseDType(n); })
      .def_readwrite("chunk_payload_bytes", &JobDef::chunk_payload_bytes)
      .def_readwrite("max_chunk_bytes", &JobDef::max_chunk_bytes)
      .def_property(
          "checkpoint_every_steps", [](const JobDef& d) { return d.checkpoint.every_steps; },
          [](JobDef& d, uint64_t v) { d.checkpoint.every_steps = v; })
      .def_property(
          "checkpoint_every_seconds", [](const JobDef& d) { return d.checkpoint.every_seconds; },
          [](JobDef& d, uint64_t v) { d.checkpoint.every_seconds = v; })
      .def_property(
          "checkpoint_keep_last", [](const JobDef& d) { return d.checkpoint.keep_last; },
          [](JobDef& d, uint32_t v) { d.checkpoint.keep_last = v; })
      .def_readwrite("replication", &JobDef::replication)
      .def_readwrite("param_groups", &JobDef::param_groups)
      .def_readwrite("max_grad_norm", &JobDef::max_grad_norm)
      .def_readwrite("skip_nonfinite", &JobDef::skip_nonfinite);

  py::class_<JobConfig>(m, "JobConfig", "A parsed job spec (client/job_config.h, docs/job-spec.md).")
      .def_readonly("job", &JobConfig::def, "The JobDef the document describes.")
      .def_readonly("group_match", &JobConfig::group_match,
                    "Per parameter group, its tensor-name globs (empty: the default group).")
      .def_readonly("has_name", &JobConfig::has_name)
      .def_readonly("has_world_size", &JobConfig::has_world_size)
      .def_readonly("has_tensors", &JobConfig::has_tensors)
      .def_readonly("model", &JobConfig::model,
                    "The preset the spec's `model:` named (e.g. 'llama-7b'); empty: none.");
  m.def(
      "parse_job_config",
      [](const std::string& text, const std::string& source) {
        return Value(ParseJobConfig(text, source));
      },
      py::arg("text"), py::arg("source") = "<inline>",
      "Parses a YAML/JSON job spec; InvalidArgument naming source:line: field.");
  m.def(
      "load_job_config", [](const std::string& path) { return Value(LoadJobConfig(path)); },
      py::arg("path"));
  m.def(
      "assign_groups",
      [](const JobConfig& config, JobDef def) {
        Check(AssignGroups(config, &def));
        return def;
      },
      py::arg("config"), py::arg("job"),
      "A copy of `job` whose tensors' groups come from the config's patterns (and whose "
      "param_groups may gain the default group).");
  m.def("glob_match", &GlobMatch, py::arg("pattern"), py::arg("name"));

  m.def(
      "checkpoint_at",
      [](const std::string& coordinator, const std::string& job_name, uint64_t step,
         double timeout_s, const std::string& job_token) {
        absl::StatusOr<std::string> path;
        {
          py::gil_scoped_release release;
          path = CheckpointAt(coordinator, job_name, job_token, step, Secs(timeout_s));
        }
        return Value(std::move(path));
      },
      py::arg("coordinator"), py::arg("job_name"), py::arg("step"), py::arg("timeout_s") = 120.0,
      py::arg("job_token") = "",
      "Checkpoints the job at version `step` (no rank may push step `step` meanwhile) and "
      "returns the complete checkpoint's folder (the coordinator's --checkpoint_dir must be "
      "readable here).");
  m.def(
      "read_checkpoint",
      [](const std::string& dir) {
        v1::CheckpointManifest manifest;
        std::vector<uint64_t> steps;
        absl::Status status;
        {
          py::gil_scoped_release release;
          auto mf = ckpt::ReadManifest(dir);
          if (!mf.ok()) {
            status = mf.status();
          } else {
            manifest = *std::move(mf);
            auto st = ckpt::OptimizerStepsOf(dir, manifest);
            if (st.ok()) {
              steps = *std::move(st);
            } else {
              status = st.status();
            }
          }
        }
        Check(status);
        py::dict out;
        out["step"] = manifest.step();
        out["job_name"] = manifest.job_name();
        out["last_lr"] = manifest.last_lr();
        out["arrays"] = std::vector<std::string>(manifest.arrays().begin(), manifest.arrays().end());
        py::list tensors;
        for (int i = 0; i < manifest.spec().tensors_size(); ++i) {
          const auto& t = manifest.spec().tensors(i);
          py::dict d;
          d["name"] = t.name();
          d["shape"] = std::vector<int64_t>(t.shape().begin(), t.shape().end());
          d["optimizer_steps"] = i < static_cast<int>(steps.size()) ? steps[i] : 0;
          tensors.append(d);
        }
        out["tensors"] = tensors;
        return out;
      },
      py::arg("dir"), "A checkpoint folder's manifest: step, arrays, tensors.");
  m.def(
      "read_checkpoint_tensor",
      [](const std::string& dir, uint32_t tensor, const std::vector<uintptr_t>& dst,
         uint64_t num_elems) {
        absl::Status s;
        {
          py::gil_scoped_release release;
          auto mf = ckpt::ReadManifest(dir);
          if (!mf.ok()) {
            s = mf.status();
          } else if (tensor >= static_cast<uint32_t>(mf->spec().tensors_size())) {
            s = absl::InvalidArgumentError(absl::StrCat("no tensor ", tensor, " in ", dir));
          } else {
            std::vector<float*> out;
            for (uintptr_t a : dst) out.push_back(reinterpret_cast<float*>(a));
            s = ckpt::ReadTensorRange(dir, *mf, tensor, 0, num_elems, out);
          }
        }
        Check(s);
      },
      py::arg("dir"), py::arg("tensor"), py::arg("dst"), py::arg("num_elems"),
      "Reads tensor `tensor`'s arrays (master, then moments) into the fp32 buffers at `dst`.");

  py::class_<StepReport>(m, "StepReport")
      .def_readonly("grad_norm", &StepReport::grad_norm)
      .def_readonly("clip_coef", &StepReport::clip_coef)
      .def_readonly("found_inf", &StepReport::found_inf)
      .def_readonly("skipped", &StepReport::skipped)
      .def("__repr__", [](const StepReport& r) {
        return absl::StrCat("StepReport(grad_norm=", r.grad_norm, ", clip_coef=", r.clip_coef,
                            ", found_inf=", r.found_inf ? "True" : "False",
                            ", skipped=", r.skipped ? "True" : "False", ")");
      });

  py::class_<TensorInfo>(m, "TensorInfo")
      .def_readonly("name", &TensorInfo::name)
      .def_readonly("shape", &TensorInfo::shape)
      .def_readonly("num_elems", &TensorInfo::num_elems)
      .def_readonly("num_chunks", &TensorInfo::num_chunks)
      .def_readonly("group", &TensorInfo::group)
      .def_readonly("frozen", &TensorInfo::frozen);

  py::class_<PyClient, std::shared_ptr<PyClient>>(m, "Client")
      .def_static("connect", &Connect, py::arg("coordinator"), py::arg("transports") = "",
                  py::arg("net_devices") = "", py::arg("name") = "",
                  py::arg("rpc_timeout_s") = 10.0, py::arg("ready_timeout_s") = 60.0,
                  py::arg("registration_cache_bytes") = uint64_t{4} << 30,
                  "Starts the data plane and opens the control channel (Client::Connect).")
      .def("close", &PyClient::Close, "Stops the data plane (the client is unusable after).")
      .def_property_readonly(
          "job_token", [](PyClient& c) { return c.get()->job_token(); },
          "The job token this client uses (a secret: OPTIMUS_JOB_TOKEN for the other ranks).")
      .def(
          "create_job",
          [](PyClient& c, const JobDef& def) {
            Client* cl = c.get();
            absl::Status s;
            {
              py::gil_scoped_release release;
              s = cl->CreateJob(def);
            }
            Check(s);
          },
          py::arg("job"))
      .def(
          "join",
          [](PyClient& c, const std::string& name, uint32_t rank, uint32_t world_size) {
            Client* cl = c.get();
            absl::Status s;
            {
              py::gil_scoped_release release;
              s = cl->Join(name, rank, world_size);
            }
            Check(s);
          },
          py::arg("name"), py::arg("rank"), py::arg("world_size"))
      .def("leave",
           [](PyClient& c) {
             Client* cl = c.get();
             absl::Status s;
             {
               py::gil_scoped_release release;
               s = cl->Leave();
             }
             Check(s);
           })
      .def_property_readonly("tensors", [](PyClient& c) { return c.get()->tensors(); })
      .def("tensor_index",
           [](PyClient& c, const std::string& name) { return Value(c.get()->TensorIndex(name)); })
      .def_property_readonly("rank", [](PyClient& c) { return c.get()->rank(); })
      .def_property_readonly("world_size", [](PyClient& c) { return c.get()->world_size(); })
      .def_property_readonly(
          "grad_dtype", [](PyClient& c) { return std::string(DTypeName(c.get()->grad_dtype())); })
      .def_property_readonly(
          "param_dtype", [](PyClient& c) { return std::string(DTypeName(c.get()->param_dtype())); })
      .def_property_readonly("optimizer",
                             [](PyClient& c) { return OptimizerName(c.get()->optimizer()); })
      .def_property_readonly("num_param_groups",
                             [](PyClient& c) { return c.get()->num_param_groups(); })
      .def_property_readonly("resume_step", [](PyClient& c) { return c.get()->resume_step(); })
      .def_property_readonly("resume_lr", [](PyClient& c) { return c.get()->resume_lr(); })
      .def_property_readonly("job_id", [](PyClient& c) { return c.get()->job_id(); })
      .def_property_readonly("map_epoch", [](PyClient& c) { return c.get()->map_epoch(); })
      .def_property_readonly("requests_resent",
                             [](PyClient& c) { return c.get()->requests_resent(); })
      .def_property_readonly("replies_refused",
                             [](PyClient& c) { return c.get()->replies_refused(); })
      .def_property_readonly("transports_in_use",
                             [](PyClient& c) { return c.get()->transports_in_use(); })
      .def(
          "init_tensor",
          [](PyClient& c, uint32_t tensor, uintptr_t values, size_t num_elems) {
            Client* cl = c.get();
            absl::Status s;
            {
              py::gil_scoped_release release;
              s = cl->InitTensor(tensor, static_cast<const float*>(Addr(values)), num_elems);
            }
            Check(s);
          },
          py::arg("tensor"), py::arg("values"), py::arg("num_elems"),
          "Sends num_elems fp32 values at address `values` as version 1 (blocking).")
      .def(
          "init_tensor_state",
          [](PyClient& c, uint32_t tensor, uintptr_t master, uintptr_t m, uintptr_t v,
             size_t num_elems, uint64_t steps, float last_lr) {
            Client* cl = c.get();
            TensorState st;
            st.master = static_cast<const float*>(Addr(master));
            st.m = static_cast<const float*>(Addr(m));
            st.v = static_cast<const float*>(Addr(v));
            st.steps = steps;
            st.last_lr = last_lr;
            absl::Status s;
            {
              py::gil_scoped_release release;
              s = cl->InitTensorState(tensor, st, num_elems);
            }
            Check(s);
          },
          py::arg("tensor"), py::arg("master"), py::arg("m"), py::arg("v"), py::arg("num_elems"),
          py::arg("steps"), py::arg("last_lr") = 0.0f,
          "Like init_tensor with the optimizer's moments (fp32 addresses; 0 for none).")
      .def(
          "push",
          [](PyClient& c, uint32_t tensor, uint64_t step, uintptr_t grad, size_t num_elems,
             std::optional<float> lr, float grad_mult) {
            Client* cl = c.get();
            PushOptions o;
            o.lr = lr;
            o.grad_mult = grad_mult;
            absl::StatusOr<Ticket> t;
            {
              py::gil_scoped_release release;
              t = cl->Push(tensor, step, Addr(grad), num_elems, o);
            }
            return Value(std::move(t));
          },
          py::arg("tensor"), py::arg("step"), py::arg("grad"), py::arg("num_elems"),
          py::arg("lr") = py::none(), py::arg("grad_mult") = 0.0f,
          "Pushes num_elems of the grad dtype at address `grad` (0: no gradient) for `step` "
          "with learning rate `lr` (None: the job's); returns a ticket.")
      .def(
          "pull",
          [](PyClient& c, uint32_t tensor, uint64_t version, uintptr_t dst, size_t num_elems) {
            Client* cl = c.get();
            absl::StatusOr<Ticket> t;
            {
              py::gil_scoped_release release;
              t = cl->Pull(tensor, version, const_cast<void*>(Addr(dst)), num_elems);
            }
            return Value(std::move(t));
          },
          py::arg("tensor"), py::arg("version"), py::arg("dst"), py::arg("num_elems"),
          "Pulls `version` into num_elems of the param dtype at address `dst`; returns a ticket.")
      .def(
          "wait",
          [](PyClient& c, Ticket ticket, double timeout_s) {
            Client* cl = c.get();
            absl::Status s;
            {
              py::gil_scoped_release release;
              s = cl->Wait(ticket, Secs(timeout_s));
            }
            Check(s);
          },
          py::arg("ticket"), py::arg("timeout_s") = 60.0)
      .def(
          "wait_all",
          [](PyClient& c, const std::vector<Ticket>& tickets, double timeout_s) {
            Client* cl = c.get();
            absl::Status first;
            {
              py::gil_scoped_release release;
              const absl::Time deadline = absl::Now() + Secs(timeout_s);
              for (Ticket t : tickets) {
                absl::Status s = cl->Wait(t, std::max(deadline - absl::Now(), absl::ZeroDuration()));
                if (!s.ok() && first.ok()) first = s;
              }
            }
            Check(first);
          },
          py::arg("tickets"), py::arg("timeout_s") = 60.0,
          "Waits for every ticket (each consumed); raises the first error.")
      .def(
          "step_result",
          [](PyClient& c, uint64_t step, double timeout_s) {
            Client* cl = c.get();
            absl::StatusOr<StepReport> r;
            {
              py::gil_scoped_release release;
              r = cl->StepResult(step, Secs(timeout_s));
            }
            return Value(std::move(r));
          },
          py::arg("step"), py::arg("timeout_s") = 60.0)
      .def(
          "register_buffer",
          [](PyClient& c, uintptr_t data, size_t size_bytes) {
            Client* cl = c.get();
            absl::Status s;
            {
              py::gil_scoped_release release;
              s = cl->RegisterBuffer(Addr(data), size_bytes);
            }
            Check(s);
          },
          py::arg("data"), py::arg("size_bytes"))
      .def(
          "forget_buffer",
          [](PyClient& c, uintptr_t data, size_t size_bytes) {
            Client* cl = c.get();
            py::gil_scoped_release release;
            return cl->ForgetBuffer(Addr(data), size_bytes);
          },
          py::arg("data"), py::arg("size_bytes"))
      .def("cork", [](PyClient& c) { c.get()->Cork(); },
           "Batches this thread's small requests until uncork() (Client::Cork).")
      .def("uncork", [](PyClient& c) {
        Client* cl = c.get();
        py::gil_scoped_release release;
        cl->Uncork();
      });

  py::class_<PySession>(m, "Session",
                        "client::JoinOrCreate's session: rank 0 creates the job, every rank "
                        "joins with retries; rank/world size/coordinator/job name from the "
                        "arguments or RANK, WORLD_SIZE, OPTIMUS_COORDINATOR, OPTIMUS_JOB; a job "
                        "spec file (OPTIMUS_JOB_SPEC) replaces the job's settings.")
      .def_static("join_or_create", &PySession::JoinOrCreate, py::arg("job"),
                  py::arg("coordinator") = "", py::arg("rank") = -1, py::arg("world_size") = -1,
                  py::arg("job_name") = "", py::arg("job_spec_path") = "",
                  py::arg("join_timeout_s") = 120.0, py::arg("transports") = "",
                  py::arg("net_devices") = "", py::arg("rpc_timeout_s") = 10.0,
                  py::arg("ready_timeout_s") = 60.0)
      .def_property_readonly("client", &PySession::client)
      .def_property_readonly("rank", [](const PySession& s) { return s.session().rank; })
      .def_property_readonly("world_size",
                             [](const PySession& s) { return s.session().world_size; })
      .def_property_readonly("job_name", [](const PySession& s) { return s.session().job_name; })
      .def_property_readonly("job", [](const PySession& s) { return s.session().def; })
      .def_property_readonly("created", [](const PySession& s) { return s.session().created; })
      .def_property_readonly("needs_init",
                             [](const PySession& s) { return s.session().needs_init; })
      .def("rejoin", &PySession::Rejoin,
           "After the job failed and the coordinator restored it from a checkpoint: joins "
           "the restored job with a new client (returned; the old one is closed).");
}
