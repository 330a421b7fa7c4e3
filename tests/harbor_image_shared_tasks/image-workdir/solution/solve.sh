#!/bin/bash
# Works in the image's WORKDIR, writes outside it (/etc) and leaves a process running.
[ "$(pwd)" = /testbed ] && [ -f main.py ] || exit 1
echo fixed > status.txt
echo fixed > /etc/gyre-fixed
setsid bash -c 'while true; do date +%s%N > /var/tmp/beat; sleep 0.2; done' > /dev/null 2>&1 < /dev/null &
echo $! > /var/tmp/beat.pid
for _ in $(seq 50); do [ -s /var/tmp/beat ] && break; sleep 0.2; done
