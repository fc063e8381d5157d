"""`python -m router.collectors`: the collectors' process a router starts (router/collectors/
process.py); not run by hand. Ctrl-C goes to its parent, which ends it."""

from __future__ import annotations

import signal

import uvloop

from router.collectors.process import child

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    uvloop.run(child())
