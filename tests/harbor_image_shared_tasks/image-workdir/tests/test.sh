#!/bin/bash
# Reward 1 when the workdir's file, the file under /etc and the running service are all there.
pid=$(cat /var/tmp/beat.pid 2>/dev/null)
before=$(cat /var/tmp/beat 2>/dev/null)
beating=0
[ -n "$pid" ] || { echo 0 > /logs/verifier/reward.txt; exit 0; }  # nothing was started
for _ in $(seq 50); do  # a fresh beat within 10 s (a loaded machine is slow)
  sleep 0.2
  now=$(cat /var/tmp/beat 2>/dev/null)
  if [ -n "$now" ] && [ "$now" != "$before" ]; then beating=1; break; fi
done
if [ "$(pwd)" = /testbed ] && [ "$(cat status.txt 2>/dev/null)" = fixed ] && [ "$(cat /etc/gyre-fixed 2>/dev/null)" = fixed ] \
  && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ $beating = 1 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
