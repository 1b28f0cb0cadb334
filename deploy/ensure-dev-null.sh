#!/usr/bin/env bash
# Put /dev/null back if the machine came up with a regular file in its place.
#
# Some machines here boot with /dev/null as a plain file. Every writer then
# appends to it and every reader gets what was written: build scripts that
# probe rustc (rustix's) send their diagnostics there, a later rustc reading
# "nothing" from /dev/null parses that text as source, and clippy fails in
# seconds with "unknown start of token" in <anon> (stops 52 and 53).
set -euo pipefail
if [ -c /dev/null ]; then
  exit 0
fi
echo "ci: /dev/null is a $(stat -c %F /dev/null), not the null device; recreating it" >&2
# Made beside it and renamed over it, so a refused mknod leaves the file.
if mknod -m 666 /dev/null.tidepool c 1 3; then
  mv -f /dev/null.tidepool /dev/null
else
  echo "ci: cannot make the null device; emptying the file instead" >&2
  : >/dev/null
fi
