#!/bin/bash
# The create step's oracle; it also leaves a mark outside the workdir for the next step to find.
echo one > notes.txt
echo created > /tmp/created-mark
