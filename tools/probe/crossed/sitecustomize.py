"""Imported by every Python process started with this folder on PYTHONPATH (tools/probe/files_crossed.py):
appends to $GYRE_CROSSED_DIR/<pid>.txt each gyre/ source file in which a function first runs. A
line is written at once, so a process that ends by os._exit loses nothing."""

import os
import sys
import threading

_out = os.environ.get("GYRE_CROSSED_DIR")
if _out:
    _seen: set[str] = set()
    _log = open(os.path.join(_out, f"{os.getpid()}.txt"), "a", buffering=1)

    def _profile(frame, event, _arg):
        code = frame.f_code
        name = code.co_filename
        if event == "call" and name not in _seen and code.co_name != "<module>" and "/gyre/" in name:
            _seen.add(name)
            _log.write(name + "\n")

    sys.setprofile(_profile)
    threading.setprofile(_profile)
