"""Wraps libraries installed by Debian's packages as Bazel cc_library targets.

Each repository asks pkg-config (or takes explicit flags) once, at fetch time,
and exposes one target, `:lib`. Headers under /usr/include are already visible
to the host toolchain; extra include directories are symlinked into the
repository so that Bazel's header checks accept them.
"""

def _split_flags(flags):
    defines, includes, linkopts = [], [], []
    for f in flags:
        if f.startswith("-D"):
            defines.append(f[2:])
        elif f.startswith("-I"):
            includes.append(f[2:])
        elif f:
            linkopts.append(f)
    return defines, includes, linkopts

def _system_library_impl(ctx):
    flags = []
    if ctx.attr.pkgs:
        pc = ctx.which("pkg-config")
        if not pc:
            fail("pkg-config not found; run scripts/install_deps.sh")
        res = ctx.execute([pc, "--cflags", "--libs"] + ctx.attr.pkgs)
        if res.return_code != 0:
            fail("pkg-config %s failed (run scripts/install_deps.sh): %s" % (ctx.attr.pkgs, res.stderr))
        flags = res.stdout.strip().split(" ")
    defines, includes, linkopts = _split_flags(flags)
    linkopts = linkopts + ctx.attr.extra_linkopts
    defines = defines + ctx.attr.extra_defines

    # Extra include directories (outside the toolchain's built-in ones) are
    # linked into the repository and exported with `includes`.
    inc_attrs = []
    for i, d in enumerate(ctx.attr.include_dirs + [x for x in includes if x != "/usr/include"]):
        if not ctx.path(d).exists:
            fail("include directory %s missing; run scripts/install_deps.sh" % d)
        name = "inc%d" % i
        ctx.symlink(d, name)
        inc_attrs.append(name)

    for f in ctx.attr.required_files:
        if not ctx.path(f).exists:
            fail("%s missing; run scripts/install_deps.sh" % f)

    ctx.file("BUILD", """
cc_library(
    name = "lib",
    hdrs = glob([{hdr_globs}], allow_empty = True),
    includes = {includes},
    defines = {defines},
    linkopts = {linkopts},
    visibility = ["//visibility:public"],
)
""".format(
        hdr_globs = ", ".join(['"%s/**"' % n for n in inc_attrs]),
        includes = repr(inc_attrs),
        defines = repr(defines),
        linkopts = repr(linkopts),
    ))

system_library = repository_rule(
    implementation = _system_library_impl,
    attrs = {
        "pkgs": attr.string_list(doc = "pkg-config package names"),
        "include_dirs": attr.string_list(doc = "extra absolute include directories"),
        "extra_linkopts": attr.string_list(),
        "extra_defines": attr.string_list(),
        "required_files": attr.string_list(doc = "absolute paths that must exist"),
    },
    local = True,
)
