#!/bin/bash
# [verifier].env's EXPECTED comes from the host (or its default); GREETING is set here too.
if [ "$(cat greeting.txt 2>/dev/null)" = "$EXPECTED" ] && [ "$GREETING" = "$EXPECTED" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
