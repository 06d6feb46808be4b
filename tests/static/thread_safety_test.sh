#!/usr/bin/env bash
# The thread-safety check ran (it is a build step: a violation fails the
# build) and covered the sources it must: prints what it checked.
set -euo pipefail
log="${TEST_SRCDIR}/optimus/tests/static/thread_safety.log"
cat "${log}"
grep -q " 0 failed$" "${log}" || { echo "thread-safety violations"; exit 1; }
for pkg in server coordinator client transport common cli kernels/cpu; do
  grep -q "^ok ${pkg}/" "${log}" || { echo "no file of ${pkg}/ was checked"; exit 1; }
done
