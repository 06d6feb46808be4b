#!/usr/bin/env python3
"""Counts test cases from bazel's test.xml files (GoogleTest results).

Usage: count_tests.py BAZEL_OUTPUT_LOG TESTLOGS_DIR [BAZEL_OUTPUT_LOG TESTLOGS_DIR ...]
One pair per `bazel test` run (scripts/test.sh makes two: the default build,
and --config=fuzz with its own testlogs folder). Prints one line for all of
them: "N passed, N failed, N skipped". A test target that failed to build,
timed out or crashed without a result file counts as one failure. Exits 1 if
anything failed or nothing ran.
"""
import os
import re
import sys
import xml.etree.ElementTree as ET


def count(log_path, testlogs):
    """(passed, failed, skipped) of one bazel test run."""
    with open(log_path, errors="replace") as f:
        log = f.read()
    # Targets bazel reported in this run, with their outcome.
    outcomes = {}
    for m in re.finditer(r"^(//\S+)\s+(?:\(cached\)\s+)?(PASSED|FAILED|TIMEOUT|NO STATUS|"
                         r"FAILED TO BUILD|FLAKY|SKIPPED)", log, re.M):
        outcomes[m.group(1)] = m.group(2)
    passed = failed = skipped = 0
    for target, outcome in outcomes.items():
        xml = os.path.join(testlogs, target[2:].replace(":", "/"), "test.xml")
        counted = False
        failed_before = failed
        if outcome in ("PASSED", "FAILED", "FLAKY") and os.path.exists(xml):
            try:
                root = ET.parse(xml).getroot()
                for case in root.iter("testcase"):
                    counted = True
                    if case.find("failure") is not None or case.find("error") is not None:
                        failed += 1
                    elif case.get("result") == "skipped" or case.find("skipped") is not None:
                        skipped += 1
                    else:
                        passed += 1
            except ET.ParseError:
                pass
        if not counted:
            if outcome in ("PASSED",):
                passed += 1
            elif outcome == "SKIPPED":
                skipped += 1
            else:
                failed += 1
        elif outcome in ("FAILED", "TIMEOUT") and failed == failed_before:
            # The target failed although every recorded case passed (a crash
            # at exit, a leaked process, ...): count the target itself.
            failed += 1
    if "FAILED: Build did NOT complete successfully" in log and not any(
            o == "FAILED TO BUILD" for o in outcomes.values()):
        failed += 1
    return passed, failed, skipped


def main():
    args = sys.argv[1:]
    if not args or len(args) % 2 != 0:
        print("usage: count_tests.py BAZEL_OUTPUT_LOG TESTLOGS_DIR [...]", file=sys.stderr)
        return 2
    passed = failed = skipped = 0
    for i in range(0, len(args), 2):
        p, f, s = count(args[i], args[i + 1])
        passed, failed, skipped = passed + p, failed + f, skipped + s
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or passed + skipped == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
