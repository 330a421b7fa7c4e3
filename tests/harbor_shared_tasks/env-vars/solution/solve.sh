#!/bin/bash
# [environment].env gives GREETING, [solution].env gives TARGET.
printf '%s\n' "$GREETING" > "$TARGET"
