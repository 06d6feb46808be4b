// Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/)
// from real, valid inputs made by the project's own writers (wire headers,
// serialized job specs, checkpoints written by common/checkpoint_files),
// plus a few edge cases each. Reproducers of fixed bugs are added to the
// corpus folders by hand and are not touched here.
//
//   bazel run //tests/fuzz:make_seeds -- "$PWD/tests/fuzz/corpus"
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
#include "common/dtype.h"
#include "common/wire.h"
#include "google/protobuf/text_format.h"
#include "proto/optimus.pb.h"
#include "tests/fuzz/shard_input.h"

namespace optimus {
namespace fuzz {
namespace {

std::string g_root;

void Put(const std::string& target, const std::string& name, const std::string& bytes) {
  const std::string dir = absl::StrCat(g_root, "/", target);
  if (!ckpt::MakeDirs(dir).ok()) {
    std::fprintf(stderr, "cannot make %s\n", dir.c_str());
    std::exit(1);
  }
  std::ofstream out(absl::StrCat(dir, "/", name), std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "cannot write %s/%s\n", dir.c_str(), name.c_str());
    std::exit(1);
  }
}

std::string Floats(size_t n, float scale, size_t arrays = 1) {
  std::vector<float> v(n * arrays);
  for (size_t i = 0; i < v.size(); ++i) v[i] = scale * static_cast<float>(i % 13) - 0.25f;
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

std::string Cast(const std::string& fp32, DType to) {
  const size_t n = fp32.size() / 4;
  std::string out(n * DTypeSize(to), '\0');
  const float* f = reinterpret_cast<const float*>(fp32.data());
  for (size_t i = 0; i < n; ++i) {
    if (to == DType::kBf16) {
      const uint16_t b = FloatToBf16(f[i]);
      std::memcpy(&out[i * 2], &b, 2);
    } else if (to == DType::kFp16) {
      const uint16_t h = FloatToFp16(f[i]);
      std::memcpy(&out[i * 2], &h, 2);
    } else {
      std::memcpy(&out[i * 4], &f[i], 4);
    }
  }
  return out;
}

wire::RequestHeader Req(wire::Op op, uint32_t tensor, uint32_t chunk, uint64_t step, uint32_t rank,
                        DType dtype, uint64_t num_bytes, uint64_t id) {
  wire::RequestHeader h;
  h.op = static_cast<uint16_t>(op);
  h.tensor = tensor;
  h.chunk = chunk;
  h.step = step;
  h.rank = rank;
  h.dtype = static_cast<uint8_t>(dtype);
  h.num_bytes = num_bytes;
  h.request_id = id;
  if (op == wire::Op::kPush) h.lr = 1e-2f;
  return h;
}

// ---- wire ----
void WireSeeds() {
  wire::RequestHeader push = Req(wire::Op::kPush, 0, 0, 1, 0, DType::kBf16, 8 << 20, 1);
  push.job_id = 5;
  push.map_epoch = 1;
  Put("wire", "push", HeaderBytes(push));
  wire::RequestHeader pull = Req(wire::Op::kPull, 3, 1, 2, 1, DType::kBf16, 4 << 20, 2);
  Put("wire", "pull", HeaderBytes(pull));
  wire::RequestHeader init = Req(wire::Op::kInit, 0, 0, 1, 0, DType::kFp32, 16 << 20, 3);
  init.step_flags = wire::kInitState;
  init.optimizer_steps = 10;
  Put("wire", "init_state", HeaderBytes(init));
  wire::RequestHeader commit = Req(wire::Op::kCommit, 0, 0, 4, 0, DType::kBf16, 0, 4);
  commit.clip_coef = 0.5f;
  Put("wire", "commit", HeaderBytes(commit));
  wire::RequestHeader rep = Req(wire::Op::kReplicate, 1, 0, 7, 99, DType::kFp32, 1024, 5);
  rep.flags = wire::kReplicateSum;
  rep.grad_sum_squares = 2.5;
  Put("wire", "replicate", HeaderBytes(rep));
  wire::RequestHeader batch = Req(wire::Op::kBatch, 0, 0, 2, 0, DType::kBf16, 2 * 96 + 64, 6);
  Put("wire", "batch_headers", HeaderBytes(batch) + HeaderBytes(push) + HeaderBytes(pull));
  const wire::ReplyHeader ok = wire::OkReplyHeader(9, 2, 0);
  Put("wire", "reply_ok", std::string(reinterpret_cast<const char*>(&ok), sizeof(ok)));
  Put("wire", "reply_error",
      wire::EncodeReply(10, absl::FailedPreconditionError("stale shard map: epoch 1 < 2"), 0,
                        wire::kReplyRefreshMap));
  // Edge cases: empty, one byte short, bad magic, a NaN lr, a reply whose
  // message length runs past its end.
  Put("wire", "empty", "");
  Put("wire", "short", HeaderBytes(push).substr(0, 95));
  wire::RequestHeader bad = push;
  bad.magic = 0x12345678;
  Put("wire", "bad_magic", HeaderBytes(bad));
  bad = push;
  bad.lr = __builtin_nanf("");
  Put("wire", "nan_lr", HeaderBytes(bad));
  std::string long_msg = wire::EncodeReply(11, absl::InternalError("x"), 0, 0);
  long_msg[20] = 100;  // message_len's low byte.
  Put("wire", "reply_bad_len", long_msg);
}

// ---- job_spec ----
v1::JobSpec GptSpec() {
  v1::JobSpec s;
  s.set_name("gpt-small");
  s.set_world_size(8);
  const std::vector<std::pair<const char*, std::vector<int64_t>>> tensors = {
      {"embed.weight", {50304, 768}}, {"h.0.attn.weight", {768, 2304}},
      {"h.0.attn.bias", {2304}},      {"h.0.ln.weight", {768}}};
  for (const auto& [name, shape] : tensors) {
    v1::TensorSpec* t = s.add_tensors();
    t->set_name(name);
    for (int64_t d : shape) t->add_shape(d);
    t->set_group(std::string(name).find("weight") != std::string::npos &&
                         std::string(name).find("ln") == std::string::npos
                     ? 0
                     : 1);
  }
  v1::ParamGroup* decay = s.add_param_groups();
  decay->set_name("decay");
  v1::ParamGroup* no_decay = s.add_param_groups();
  no_decay->set_name("no_decay");
  no_decay->set_weight_decay(0);
  no_decay->set_lr_mult(0.5f);
  s.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  s.mutable_optimizer()->set_lr(6e-4f);
  s.mutable_optimizer()->set_beta2(0.95f);
  s.mutable_optimizer()->set_weight_decay(0.1f);
  s.set_grad_dtype(v1::DTYPE_BF16);
  s.set_param_dtype(v1::DTYPE_BF16);
  s.set_max_grad_norm(1.0f);
  s.mutable_checkpoint_policy()->set_every_steps(500);
  s.mutable_checkpoint_policy()->set_keep_last(3);
  return s;
}

void JobSpecSeeds() {
  v1::JobSpec s = GptSpec();
  Put("job_spec", "gpt_small", s.SerializeAsString());
  v1::JobSpec sgd;
  sgd.set_name("resnet");
  sgd.set_world_size(4);
  sgd.set_replication(1);
  v1::TensorSpec* t = sgd.add_tensors();
  t->set_name("conv1.weight");
  for (int64_t d : {64, 3, 7, 7}) t->add_shape(d);
  v1::TensorSpec* frozen = sgd.add_tensors();
  frozen->set_name("bn.running_mean");
  frozen->add_shape(64);
  frozen->set_frozen(true);
  sgd.mutable_optimizer()->set_kind(v1::OPTIMIZER_SGD);
  sgd.mutable_optimizer()->set_lr(0.1f);
  sgd.mutable_optimizer()->set_momentum(0.9f);
  sgd.set_grad_dtype(v1::DTYPE_FP32);
  sgd.set_param_dtype(v1::DTYPE_FP32);
  sgd.set_chunk_payload_bytes(4096);
  Put("job_spec", "sgd_replicated", sgd.SerializeAsString());
  v1::JobSpec lion = sgd;
  lion.set_name("lion");
  lion.mutable_optimizer()->set_kind(v1::OPTIMIZER_LION);
  lion.mutable_optimizer()->set_lr(1e-4f);
  lion.mutable_optimizer()->set_momentum(0);
  lion.set_keep_nonfinite(true);
  lion.set_grad_dtype(v1::DTYPE_FP16);
  lion.set_param_dtype(v1::DTYPE_FP16);
  lion.set_max_chunk_bytes(64);
  Put("job_spec", "lion_small_chunks", lion.SerializeAsString());
  // Edge cases: no workers, a dimension past 2^56 elements, a million-plus
  // chunks, a group index past the groups, a NaN clip norm.
  v1::JobSpec bad = s;
  bad.set_world_size(0);
  Put("job_spec", "world_size_0", bad.SerializeAsString());
  bad = s;
  bad.mutable_tensors(0)->set_shape(0, int64_t{1} << 40);
  bad.mutable_tensors(0)->set_shape(1, int64_t{1} << 20);
  Put("job_spec", "huge_tensor", bad.SerializeAsString());
  bad = s;
  bad.set_max_chunk_bytes(4);
  Put("job_spec", "too_many_chunks", bad.SerializeAsString());
  bad = s;
  bad.mutable_tensors(1)->set_group(7);
  Put("job_spec", "bad_group", bad.SerializeAsString());
  bad = s;
  bad.set_max_grad_norm(__builtin_nanf(""));
  Put("job_spec", "nan_clip", bad.SerializeAsString());
}

// ---- checkpoint ----
std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

constexpr char kSeparator[] = "\n=FILE=\n";

void CheckpointSeeds() {
  char tmpl[] = "/tmp/make_seeds.XXXXXX";
  if (mkdtemp(tmpl) == nullptr) std::exit(1);
  const std::string dir = tmpl;
  // A two-tensor AdamW job (3 arrays: master, m, v), tensor 0 in two files
  // of 6 and 4 elements, tensor 1 in one of 3: what the shards of a real
  // checkpoint write, and the manifest the coordinator writes over them.
  v1::CheckpointManifest m;
  m.set_job_name("fuzzjob");
  m.set_checkpoint_id(7);
  m.set_step(7);
  m.set_created_unix_ms(1700000000000);
  v1::JobSpec& spec = *m.mutable_spec();
  spec.set_name("fuzzjob");
  spec.set_world_size(2);
  v1::TensorSpec* t0 = spec.add_tensors();
  t0->set_name("w");
  t0->add_shape(2);
  t0->add_shape(5);
  v1::TensorSpec* t1 = spec.add_tensors();
  t1->set_name("b");
  t1->add_shape(3);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  spec.mutable_optimizer()->set_lr(1e-3f);
  spec.set_grad_dtype(v1::DTYPE_FP32);
  spec.set_param_dtype(v1::DTYPE_FP32);
  for (const char* a : {"master", "exp_avg", "exp_avg_sq"}) m.add_arrays(a);
  struct Part {
    const char* name;
    uint32_t tensor;
    uint64_t offset, n;
  };
  const std::vector<Part> parts = {{"t0-c0.s1", 0, 0, 6}, {"t0-c1.s2", 0, 6, 4}, {"t1-c0.s1", 1, 0, 3}};
  std::vector<std::string> files;
  for (const Part& p : parts) {
    const std::string arrays = Floats(p.n, 0.5f, 3);
    const float* base = reinterpret_cast<const float*>(arrays.data());
    const float* ptrs[] = {base, base + p.n, base + 2 * p.n};
    auto rec = ckpt::WriteDataFile(dir, p.name, p.tensor, p.offset, p.n, ptrs);
    if (!rec.ok()) std::exit(1);
    rec->set_optimizer_steps(6);
    rec->set_last_lr(1e-3f);
    *m.add_files() = *rec;
    files.push_back(ReadAll(absl::StrCat(dir, "/", p.name)));
  }
  if (!ckpt::WriteManifest(dir, m).ok()) std::exit(1);
  const std::string manifest = ReadAll(absl::StrCat(dir, "/", ckpt::kManifestName));
  auto input = [&](uint8_t flags, const std::string& text, const std::vector<std::string>& fs) {
    std::string out(1, static_cast<char>(flags));
    out += text;
    for (const std::string& f : fs) absl::StrAppend(&out, kSeparator, f);
    return out;
  };
  Put("checkpoint", "real", input(0, manifest, files));
  std::string body;
  google::protobuf::TextFormat::PrintToString(m, &body);
  Put("checkpoint", "sealed", input(2, body, files));
  // Edge cases, sealed so that they reach the checks that matter: a name
  // that leaves the folder, a record whose size overflows, a data file cut
  // short, files of a tensor that overlap, a file naming a tensor the spec
  // does not have, and a manifest with no checksum line.
  v1::CheckpointManifest bad = m;
  bad.mutable_files(0)->set_name("../../../../dev/zero");
  google::protobuf::TextFormat::PrintToString(bad, &body);
  Put("checkpoint", "name_escapes", input(1, body, files));
  bad = m;
  bad.mutable_files(0)->set_num_elems(uint64_t{1} << 62);
  google::protobuf::TextFormat::PrintToString(bad, &body);
  Put("checkpoint", "size_overflow", input(1, body, files));
  std::vector<std::string> cut = files;
  cut[1] = cut[1].substr(0, 30);
  google::protobuf::TextFormat::PrintToString(m, &body);
  Put("checkpoint", "truncated_file", input(2, body, cut));
  bad = m;
  bad.mutable_files(1)->set_offset_elems(2);
  google::protobuf::TextFormat::PrintToString(bad, &body);
  Put("checkpoint", "overlap", input(2, body, files));
  bad = m;
  bad.mutable_files(2)->set_tensor(9);
  google::protobuf::TextFormat::PrintToString(bad, &body);
  Put("checkpoint", "unknown_tensor", input(2, body, files));
  Put("checkpoint", "no_checksum", input(0, body, files));
  // Files as real shards write them, but two overlap and leave a gap:
  // tensor 0's elements [0, 6) and [2, 6), nothing for [6, 10).
  {
    v1::CheckpointManifest gap = m;
    gap.clear_files();
    std::vector<std::string> gap_files;
    const std::vector<Part> gap_parts = {{"t0-c0.s1", 0, 0, 6}, {"t0-c1.s2", 0, 2, 4}, {"t1-c0.s1", 1, 0, 3}};
    for (const Part& p : gap_parts) {
      const std::string arrays = Floats(p.n, 0.25f, 3);
      const float* base = reinterpret_cast<const float*>(arrays.data());
      const float* ptrs[] = {base, base + p.n, base + 2 * p.n};
      auto rec = ckpt::WriteDataFile(dir, p.name, p.tensor, p.offset, p.n, ptrs);
      if (!rec.ok()) std::exit(1);
      *gap.add_files() = *rec;
      gap_files.push_back(ReadAll(absl::StrCat(dir, "/", p.name)));
    }
    google::protobuf::TextFormat::PrintToString(gap, &body);
    Put("checkpoint", "overlap_and_gap", input(1, body, gap_files));
  }
  (void)ckpt::RemoveTree(dir);
}

// ---- shard_requests ----
void ShardSeeds() {
  const auto req = [](const wire::RequestHeader& h, const std::string& payload,
                      uint8_t ctl = kFixHeader | kAwaitReply) {
    std::string out;
    AppendRecord(&out, ctl, HeaderBytes(h), payload);
    return out;
  };
  // Variant 0 (fp32 AdamW, replicated): init every chunk held here, both
  // ranks push step 1 of tensor 0, pull version 2; seed the backup chunk
  // (tensor 1 chunk 1) as its primary (the peer, shard 99) would.
  {
    std::string in(1, static_cast<char>(kFp32AdamWReplicated));
    in += req(Req(wire::Op::kInit, 0, 0, 1, 0, DType::kFp32, 256, 1), Floats(64, 0.1f));
    in += req(Req(wire::Op::kInit, 1, 0, 1, 0, DType::kFp32, 128, 2), Floats(32, 0.2f));
    in += req(Req(wire::Op::kPull, 0, 0, 2, 0, DType::kFp32, 256, 3), "");
    in += req(Req(wire::Op::kPush, 0, 0, 1, 0, DType::kFp32, 256, 4), Floats(64, 0.01f));
    in += req(Req(wire::Op::kPush, 0, 0, 1, 1, DType::kFp32, 256, 5), Floats(64, -0.02f));
    in += req(Req(wire::Op::kPush, 1, 0, 1, 0, DType::kFp32, 128, 6), Floats(32, 0.01f));
    in += req(Req(wire::Op::kPush, 1, 0, 1, 1, DType::kFp32, 128, 7), Floats(32, 0.03f));
    wire::RequestHeader seed = Req(wire::Op::kReplicate, 1, 1, 1, kPeerShardId, DType::kFp32,
                                   3 * 128, 8);
    seed.flags = wire::kReplicateState;
    in += req(seed, Floats(32, 0.3f, 3));
    wire::RequestHeader sum = Req(wire::Op::kReplicate, 1, 1, 1, kPeerShardId, DType::kFp32, 128, 9);
    sum.flags = wire::kReplicateSum;
    sum.lr = 1e-2f;
    in += req(sum, Floats(32, 0.05f));
    Put("shard_requests", "fp32_adamw_step", in);
  }
  // Variant 1 (bf16 SGD, clipping): init, three ranks push, the commit
  // round, pull; the frozen tensor gets no gradient.
  {
    std::string in(1, static_cast<char>(kBf16SgdClipped));
    in += req(Req(wire::Op::kInit, 0, 0, 1, 0, DType::kFp32, 256, 1), Floats(64, 0.1f));
    in += req(Req(wire::Op::kInit, 1, 0, 1, 0, DType::kFp32, 64, 2), Floats(16, 0.1f));
    for (uint32_t r = 0; r < 3; ++r) {
      in += req(Req(wire::Op::kPush, 0, 0, 1, r, DType::kBf16, 128, 10 + r),
                Cast(Floats(64, 0.01f * (r + 1)), DType::kBf16));
      wire::RequestHeader none = Req(wire::Op::kPush, 1, 0, 1, r, DType::kBf16, 0, 20 + r);
      none.step_flags = wire::kPushNoGrad;
      in += req(none, "");
    }
    for (uint32_t r = 0; r < 3; ++r) {
      for (uint32_t t = 0; t < 2; ++t) {
        wire::RequestHeader c = Req(wire::Op::kCommit, t, 0, 1, r, DType::kBf16, 0, 30 + 2 * r + t);
        c.clip_coef = 0.5f;
        in += req(c, "");
      }
    }
    in += req(Req(wire::Op::kPull, 0, 0, 2, 0, DType::kBf16, 128, 40), "");
    Put("shard_requests", "bf16_sgd_commit_round", in);
  }
  // Variant 2 (fp16 Lion, checkpoint every 2 steps), as one batch: init
  // both chunks, then two steps of pushes one batch each, then pulls.
  {
    std::string in(1, static_cast<char>(kFp16LionCheckpointed));
    auto batch = [&](const std::vector<std::pair<wire::RequestHeader, std::string>>& items,
                     uint64_t id) {
      std::string headers, payloads;
      for (const auto& [h, p] : items) {
        headers += HeaderBytes(h);
        payloads += p;
      }
      wire::RequestHeader b = Req(wire::Op::kBatch, 0, 0, items.size(), 0, DType::kFp32,
                                  headers.size() + payloads.size(), id);
      return req(b, headers + payloads, kFixHeader | kFixBatch | kAwaitReply);
    };
    in += batch({{Req(wire::Op::kInit, 0, 0, 1, 0, DType::kFp32, 192, 1), Floats(48, 0.1f)},
                 {Req(wire::Op::kInit, 0, 1, 1, 0, DType::kFp32, 64, 2), Floats(16, 0.1f)}},
                1);
    for (uint64_t step = 1; step <= 2; ++step) {
      in += batch({{Req(wire::Op::kPush, 0, 0, step, 0, DType::kFp16, 96, 10 * step),
                    Cast(Floats(48, 0.01f), DType::kFp16)},
                   {Req(wire::Op::kPush, 0, 1, step, 0, DType::kFp16, 32, 10 * step + 1),
                    Cast(Floats(16, 0.01f), DType::kFp16)}},
                  10 * step);
    }
    in += req(Req(wire::Op::kPull, 0, 0, 3, 0, DType::kFp16, 96, 50), "");
    in += req(Req(wire::Op::kPull, 0, 1, 3, 0, DType::kFp16, 32, 51), "");
    Put("shard_requests", "fp16_lion_batches_checkpoint", in);
  }
  // Edge cases: garbage bytes as they come; a forged "fenced" reply to a
  // forward nobody sent; a push for another job id; a batch whose count
  // runs past its payload.
  {
    std::string in(1, static_cast<char>(kFp32AdamWReplicated));
    AppendRecord(&in, 0, std::string(96, '\xff'), std::string(300, 'x'));
    std::string fenced = wire::EncodeReply(1, absl::FailedPreconditionError("fenced"), 0,
                                           wire::kReplyFenced);
    AppendRecord(&in, kToReplyHandler, fenced, "");
    wire::RequestHeader other = Req(wire::Op::kPush, 0, 0, 1, 0, DType::kFp32, 256, 3);
    other.job_id = 424242;
    other.map_epoch = 1;
    AppendRecord(&in, 0, HeaderBytes(other), Floats(64, 1.0f));
    wire::RequestHeader b = Req(wire::Op::kBatch, 0, 0, 4000, 0, DType::kFp32, 96, 4);
    in += req(b, HeaderBytes(Req(wire::Op::kPull, 0, 0, 1, 0, DType::kFp32, 256, 5)));
    Put("shard_requests", "edge_cases", in);
  }
}

// ---- job_config ----
void JobConfigSeeds() {
  Put("job_config", "example.yaml", R"(name: gpt-small
optimizer:
  type: AdamW
  params: {lr: 6.0e-4, betas: [0.9, 0.95], eps: 1.0e-8, weight_decay: 0.1}
gradient_clipping: 1.0
dtypes: {grad: bf16, param: bf16}
checkpoint: {every_steps: 500, keep_last: 3}
param_groups:
  - {name: no_decay, match: ["*.bias", "*ln*", "*norm*"], weight_decay: 0}
  - {name: decay}
)");
  Put("job_config", "tensors.yaml", R"(# A job created from a file alone.
name: mlp
world_size: 2
optimizer: {type: sgd, params: {lr: 0.1, momentum: 0.9}}
replication: 1
chunk_payload_bytes: 512KiB
skip_nonfinite: false
param_groups:
  - name: slow
    match: "fc1.*"
    lr_mult: 0.1
  - name: rest
tensors:
  - {name: fc1.weight, shape: [128, 64]}
  - {name: fc1.bias, shape: [128], group: rest}
  - {name: fc2.weight, shape: [10, 128], frozen: true}
)");
  Put("job_config", "spec.json", R"({
  "name": "lion-run",
  "world_size": 4,
  "optimizer": {"type": "lion", "params": {"lr": 1e-4, "betas": [0.9, 0.99]}},
  "dtypes": {"grad": "fp16", "param": "fp16"},
  "max_chunk_bytes": "4MiB",
  "checkpoint": {"every_seconds": 600}
})");
  // Edge cases: a misspelt key, a type mismatch, unbalanced flow style,
  // deep nesting, an anchor and alias, tabs.
  Put("job_config", "typo.yaml", "name: x\noptimizr: {type: adamw}\n");
  Put("job_config", "not_a_number.yaml", "optimizer:\n  params:\n    lr: fast\n");
  Put("job_config", "unbalanced.json", "{\"name\": [\"a\", {\"b\": }\n");
  Put("job_config", "deep.yaml", std::string(200, '[') + std::string(200, ']'));
  Put("job_config", "alias.yaml",
      "base: &b {lr: 0.1}\noptimizer: {type: sgd, params: *b}\n");
  Put("job_config", "tabs.yaml", "name:\tx\n\tworld_size: 2\n");
}

}  // namespace
}  // namespace fuzz
}  // namespace optimus

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds CORPUS_DIR (tests/fuzz/corpus)\n");
    return 2;
  }
  optimus::fuzz::g_root = argv[1];
  optimus::fuzz::WireSeeds();
  optimus::fuzz::JobSpecSeeds();
  optimus::fuzz::CheckpointSeeds();
  optimus::fuzz::ShardSeeds();
  optimus::fuzz::JobConfigSeeds();
  std::printf("seed corpora written under %s\n", argv[1]);
  return 0;
}
