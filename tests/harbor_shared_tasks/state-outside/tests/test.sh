#!/bin/bash
# Reward 1 when the service the agent started is still running and beating.
pid=$(cat /tmp/service/pid 2>/dev/null)
before=$(cat /tmp/service/beat 2>/dev/null)
beating=0
[ -n "$pid" ] || { echo 0 > /logs/verifier/reward.txt; exit 0; }  # nothing was started
for _ in $(seq 50); do  # a fresh beat within 10 s (a loaded machine is slow)
  sleep 0.2
  now=$(cat /tmp/service/beat 2>/dev/null)
  if [ -n "$now" ] && [ "$now" != "$before" ]; then beating=1; break; fi
done
if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && [ $beating = 1 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
