#!/bin/bash
# Leaves state outside the workdir (/tmp) and a process running: the verifier runs after it, in the same environment.
mkdir -p /tmp/service
setsid bash -c 'while true; do date +%s%N > /tmp/service/beat; sleep 0.2; done' > /dev/null 2>&1 < /dev/null &
echo $! > /tmp/service/pid
for _ in $(seq 50); do [ -s /tmp/service/beat ] && break; sleep 0.2; done
