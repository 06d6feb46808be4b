"""optimus_fuzz_test: one libFuzzer target and the test that runs it.

For a target NAME it makes:
  NAME_fuzzer  the fuzzer binary. Under --config=fuzz (clang, ASan, UBSan)
               it links libFuzzer; in the default gcc build it links
               replay_main.cc instead, which runs each corpus file once.
  NAME_test    runs the binary over corpus/NAME/: in the default build it
               replays the corpus (a regression test, a second or so);
               under --config=fuzz it fuzzes for OPTIMUS_FUZZ_SECONDS (60 by
               default) starting from the corpus. A crash, a sanitizer report
               or a leak fails it, and its log names the reproducer file.
               Tagged "external": it runs every time, never from a cache.
"""

def optimus_fuzz_test(name, srcs, deps = [], size = "medium", tags = []):
    corpus = native.glob(["corpus/%s/**" % name], allow_empty = True)
    native.cc_binary(
        name = name + "_fuzzer",
        testonly = True,
        srcs = srcs,
        deps = deps + select({
            ":fuzzing": [],
            "//conditions:default": [":replay_main"],
        }),
        linkopts = select({
            ":fuzzing": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
    )
    native.sh_test(
        name = name + "_test",
        size = size,
        srcs = ["run_fuzzer.sh"],
        args = [
            "$(location :%s_fuzzer)" % name,
            "tests/fuzz/corpus/" + name,
        ] + select({
            ":fuzzing": ["fuzz"],
            "//conditions:default": ["replay"],
        }),
        data = [":%s_fuzzer" % name] + corpus,
        # Never a cached result: each run fuzzes anew (a replay costs a
        # second).
        tags = tags + ["external"],
    )
