"""etcd's v3 gRPC API, from the .proto files Debian's golang-etcd-server-dev
installs (never copied into this repository).

The repository links the four files the client needs under their import
paths (etcd/...) and generates C++ from them at build time with Debian's
protoc and grpc_cpp_plugin. The files import gogoproto/gogo.proto (Go code
generation options) and google/api/annotations.proto (the HTTP gateway's
routes), which Debian does not ship for C++ and which mean nothing to a C++
gRPC client: the genrule strips those imports and the options that use them
with sed before protoc sees the files.
"""

_FILES = [
    "etcdserver/etcdserverpb/rpc.proto",
    "mvcc/mvccpb/kv.proto",
    "auth/authpb/auth.proto",
    "etcdserver/api/v3election/v3electionpb/v3election.proto",
]

def _etcd_api_impl(ctx):
    root = ctx.attr.path
    for f in _FILES:
        src = ctx.path("%s/%s" % (root, f))
        if not src.exists:
            fail("%s missing: install Debian's golang-etcd-server-dev (scripts/install_deps.sh)" % src)
        ctx.symlink(src, "src/etcd/" + f)
    ctx.symlink(ctx.attr.build_file, "BUILD")

etcd_api = repository_rule(
    implementation = _etcd_api_impl,
    attrs = {
        "path": attr.string(doc = "where go.etcd.io/etcd's sources are installed"),
        "build_file": attr.label(allow_single_file = True),
    },
    local = True,
)
