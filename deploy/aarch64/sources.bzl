"""The C++ sources of cc targets, read from Bazel's graph, for the aarch64
cross build (deploy/aarch64/build.sh), which runs outside Bazel.

`cc_sources(name, targets)` writes NAME.txt: for each target, the .cc files of
it and of everything it depends on (through `deps`) in this workspace, with
each file's copts (host ISA flags -m... left out). Its runfiles hold those
sources and their headers, so an sh_test that has it in `data` sees every
source of the targets without listing them: a file added to
//server:optimus-shard's dependencies reaches the cross build by itself.

NAME.txt has one line per source:
    TARGET_NAME <tab> src|gen <tab> PATH <tab> COPTS (space-separated)
where `gen` marks a generated file (the protoc outputs; build.sh makes its
own), PATH is relative to the workspace root.
"""

_CcSourcesInfo = provider(fields = ["entries", "files"])

def _cc_sources_aspect_impl(target, ctx):
    rule = ctx.rule
    copts = [c for c in getattr(rule.attr, "copts", []) if not c.startswith("-m")]
    entries, files = [], []
    for attr in ("srcs", "hdrs", "textual_hdrs"):
        for f in getattr(rule.files, attr, []):
            if f.owner.workspace_name:
                continue  # external (system) libraries: from the sysroot
            if f.extension in ("cc", "cpp", "c"):
                entries.append("%s\t%s\t%s" % (
                    "src" if f.is_source else "gen",
                    f.short_path,
                    " ".join(copts),
                ))
            if f.is_source:
                files.append(f)
    deps = [d[_CcSourcesInfo] for d in getattr(rule.attr, "deps", []) if _CcSourcesInfo in d]
    return [_CcSourcesInfo(
        entries = depset(entries, transitive = [d.entries for d in deps]),
        files = depset(files, transitive = [d.files for d in deps]),
    )]

_cc_sources_aspect = aspect(
    implementation = _cc_sources_aspect_impl,
    attr_aspects = ["deps"],
)

def _cc_sources_impl(ctx):
    lines, files = [], []
    for t in ctx.attr.targets:
        info = t[_CcSourcesInfo]
        for e in sorted(info.entries.to_list()):
            lines.append("%s\t%s" % (t.label.name, e))
        files.append(info.files)
    manifest = ctx.actions.declare_file(ctx.label.name + ".txt")
    ctx.actions.write(manifest, "\n".join(lines) + "\n")
    return [DefaultInfo(
        files = depset([manifest]),
        runfiles = ctx.runfiles(files = [manifest], transitive_files = depset(transitive = files)),
    )]

cc_sources = rule(
    implementation = _cc_sources_impl,
    attrs = {
        "targets": attr.label_list(aspects = [_cc_sources_aspect]),
    },
)
